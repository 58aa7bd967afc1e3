"""Chat messages → the prompt token IDs for one model call: templating plus the prefix splice.

``build_prompt`` is the one entry point the local backend calls (for generation and for
``/tokenize`` alike, so ``/tokenize`` answers the IDs generation would see). It renders the chat
template a constant number of times per call (once without token fields, twice with them) and
tokenizes only what is new, so a 100-turn rollout costs what its last turn's text costs, not 100
re-tokenizations.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gymserve.errors import InvalidRequestError
from gymserve.prompting.prefix import prefix_mismatch, required_prefix_turn
from gymserve.prompting.splice import find_spliced_turn, find_turn_suffix, splice_token_ids
from gymserve.prompting.template import TAIL_CHARS, ChatTemplate


@dataclass
class PromptResult:
    """The prompt of one model call.

    ``token_ids``: the prompt IDs to generate from. ``text_tail``: the last ``TAIL_CHARS`` (64)
    characters of the prompt text (for the reasoning parser; may be shorter when spliced and the
    text after the spliced turn is short and the model's tokens decode to little).
    ``spliced``: True when the prompt starts with an earlier turn's exact prompt + generation (or
    with ``required_prefix_token_ids``).
    """

    token_ids: list[int]
    text_tail: str
    spliced: bool


@dataclass(frozen=True)
class RenderOptions:
    """How the prompt ends and is encoded: vLLM's chat-request and ``/tokenize`` extras of the same names.

    ``add_generation_prompt``: end with the template's assistant header (the default; False renders
    the conversation as it is). ``continue_final_message``: leave the final message open, without
    its end-of-turn token, so the model continues it ("prefill"); never together with
    ``add_generation_prompt`` (vLLM refuses the pair the same way). ``add_special_tokens``: add the
    tokenizer's own special tokens (a BOS) around the rendered prompt on top of what the template
    writes; off by default, as in vLLM's chat, because templates write them. Nothing is added to a
    spliced prompt: its earlier turn's ``prompt_token_ids`` already start it.
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true: continue the final "
                "message, or start a new assistant turn; set add_generation_prompt: false to continue",
                param="continue_final_message",
            )


DEFAULT_RENDER = RenderOptions()


def build_prompt(
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    eos_token_ids: Sequence[int] = (),
    *,
    vocab_size: int,
    required_prefix: Sequence[int] | None = None,
    options: RenderOptions = DEFAULT_RENDER,
) -> PromptResult:
    """The prompt token IDs for ``messages`` (OpenAI chat messages, as the client sent them).

    No message carries token fields: the template's rendering (generation prompt per ``options``),
    tokenized. Otherwise, with k the last assistant message carrying ``prompt_token_ids`` (P) and
    ``generation_token_ids`` (G): ``P + G`` followed by the template's tokens from the end of turn
    k on (``splice_token_ids`` / ``find_turn_suffix``); messages after k without token fields are
    rendered by the template as usual, and ``token_ids[:len(P) + len(G)] == P + G`` always holds.

    ``required_prefix``: NeMo RL's ``required_prefix_token_ids`` R, the exact IDs the prompt must
    start with; it stands for the prompt + generation of the last assistant message (see
    ``prompting.prefix``). The prompt is ``R`` + the template's tokens after that message, or, when
    that message carries token fields itself, their splice, which must start with R.

    ``eos_token_ids``: every ID that ends a turn (the engine's ``eos_token_ids``); required when
    splicing (``template.turn_end_ids`` are added to them). ``vocab_size``: valid IDs are ``[0, vocab_size)``. ``options``: vLLM's
    ``add_generation_prompt`` / ``continue_final_message`` / ``add_special_tokens``.

    Raises ``InvalidRequestError`` for malformed messages, token fields or prefix (param names the
    field; code ``required_prefix_mismatch`` when the splice does not start with R) and
    ``SpliceError`` (400, code ``splice_failed``) when token fields sit on a non-assistant message or
    the end of turn k cannot be found unambiguously. Never falls back silently to re-tokenized text.
    """
    found = find_spliced_turn(messages, vocab_size)
    prepared, index = template.prepare_messages_indexed(messages)
    turn: tuple[int, list[int], list[int]] | None = None  # (k, P, G)
    if found is not None:
        turn = (found[0], found[1]["prompt_token_ids"], found[1]["generation_token_ids"])
    if required_prefix is not None:
        k = required_prefix_turn(messages, required_prefix, vocab_size)
        if turn is None or turn[0] != k:
            turn = (k, [], list(required_prefix))  # R supersedes token fields of earlier turns
    if turn is None:
        text = template.render_text(
            prepared,
            tools,
            chat_template_kwargs,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
        )
        ids = template.encode(text)
        if options.add_special_tokens:
            before, after = special_tokens(template.tokenizer)
            ids = [*before, *ids, *after]
        return PromptResult(token_ids=ids, text_tail=template.visible(text)[-TAIL_CHARS:], spliced=False)

    k, prev_prompt, prev_generation = turn
    if not eos_token_ids:
        raise ValueError("eos_token_ids is required to splice token fields (pass the engine's eos_token_ids)")
    eos_token_ids = list(dict.fromkeys([*eos_token_ids, *template.turn_end_ids]))
    if options.continue_final_message and k == len(messages) - 1:
        # The model continues its own turn: nothing of the template follows its tokens.
        ids, suffix_text = [*prev_prompt, *prev_generation], ""
    else:
        suffix = find_turn_suffix(
            template,
            prepared,
            index[k],
            tools,
            chat_template_kwargs,
            eos_token_ids,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
        )
        ids = splice_token_ids(prev_prompt, prev_generation, suffix.token_ids, eos_token_ids)
        suffix_text = suffix.text
    if required_prefix is not None and ids[: len(required_prefix)] != list(required_prefix):
        raise prefix_mismatch(required_prefix, ids, k)
    tail = template.visible(suffix_text)[-TAIL_CHARS:]
    if len(tail) < TAIL_CHARS:
        # The rendering before the suffix holds a sentinel, not the model's words: take the real
        # text of the prompt's last tokens instead (the tail only guides the reasoning parser).
        tail = template.tokenizer.decode(
            ids[-TAIL_CHARS:], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )[-TAIL_CHARS:]
    return PromptResult(token_ids=ids, text_tail=tail, spliced=True)


@functools.lru_cache(maxsize=16)
def special_tokens(tokenizer: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The IDs the tokenizer adds before and after a text with ``add_special_tokens=True`` (a BOS
    for Llama-style tokenizers; nothing for Qwen's), read off one encoding of ``"a"``."""
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return tuple(full[:i]), tuple(full[i + len(plain) :])
    return (), ()
