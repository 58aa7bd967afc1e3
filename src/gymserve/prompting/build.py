"""Chat messages → the prompt token IDs for one model call: templating plus the prefix splice.

``build_prompt`` is the one entry point the local backend calls. It renders the chat template a
constant number of times per call (once without token fields, twice with them) and tokenizes only
what is new, so a 100-turn rollout costs what its last turn's text costs, not 100 re-tokenizations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gymserve.prompting.splice import find_spliced_turn, find_turn_suffix, splice_token_ids
from gymserve.prompting.template import TAIL_CHARS, ChatTemplate


@dataclass
class PromptResult:
    """The prompt of one model call.

    ``token_ids``: the prompt IDs to generate from. ``text_tail``: the last ``TAIL_CHARS`` (64)
    characters of the prompt text (for the reasoning parser; may be shorter when spliced and the
    text after the spliced turn is short and the model's tokens decode to little).
    ``spliced``: True when the prompt starts with an earlier turn's exact prompt + generation.
    """

    token_ids: list[int]
    text_tail: str
    spliced: bool


def build_prompt(
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    eos_token_ids: Sequence[int] = (),
    *,
    vocab_size: int,
) -> PromptResult:
    """The prompt token IDs for ``messages`` (OpenAI chat messages, as the client sent them).

    No message carries token fields: the template's rendering with the generation prompt,
    tokenized. Otherwise, with k the last assistant message carrying ``prompt_token_ids`` (P) and
    ``generation_token_ids`` (G): ``P + G`` followed by the template's tokens from the end of turn
    k on (``splice_token_ids`` / ``find_turn_suffix``); messages after k without token fields are
    rendered by the template as usual, and ``token_ids[:len(P) + len(G)] == P + G`` always holds.

    ``eos_token_ids``: every ID that ends a turn (the engine's ``eos_token_ids``); required when
    splicing (``template.turn_end_ids`` are added to them). ``vocab_size``: valid IDs are ``[0, vocab_size)``.

    Raises ``InvalidRequestError`` for malformed messages or token fields (param names the field)
    and ``SpliceError`` (400, code ``splice_failed``) when token fields sit on a non-assistant
    message or the end of turn k cannot be found unambiguously. Never falls back silently to
    re-tokenized text.
    """
    found = find_spliced_turn(messages, vocab_size)
    prepared, index = template.prepare_messages_indexed(messages)
    if found is None:
        text = template.render_text(prepared, tools, chat_template_kwargs, add_generation_prompt=True)
        tail = template.visible(text)[-TAIL_CHARS:]
        return PromptResult(token_ids=template.encode(text), text_tail=tail, spliced=False)

    k, info = found
    if not eos_token_ids:
        raise ValueError("eos_token_ids is required to splice token fields (pass the engine's eos_token_ids)")
    eos_token_ids = list(dict.fromkeys([*eos_token_ids, *template.turn_end_ids]))
    suffix = find_turn_suffix(template, prepared, index[k], tools, chat_template_kwargs, eos_token_ids)
    ids = splice_token_ids(info["prompt_token_ids"], info["generation_token_ids"], suffix.token_ids, eos_token_ids)
    tail = template.visible(suffix.text)[-TAIL_CHARS:]
    if len(tail) < TAIL_CHARS:
        # The rendering before the suffix holds a sentinel, not the model's words: take the real
        # text of the prompt's last tokens instead (the tail only guides the reasoning parser).
        tail = template.tokenizer.decode(
            ids[-TAIL_CHARS:], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )[-TAIL_CHARS:]
    return PromptResult(token_ids=ids, text_tail=tail, spliced=True)
