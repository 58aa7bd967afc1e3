"""On-policy prefix splice: the next prompt starts with exactly the previous prompt + generation.

In a multi-turn rollout the client sends back the model's earlier turn as an assistant message
carrying ``prompt_token_ids`` (P) and ``generation_token_ids`` (G). Rendering that message's text
through the chat template again and tokenizing it would change the tokens (retokenization drift:
" 4" sampled as two tokens comes back as one; a sampled Chinese answer of 96 IDs re-encodes to 95)
and sometimes the text too (re-templating drift: templates strip reasoning from history, re-format
tool calls). Training on such a prompt is off-policy. So the prompt is built as::

    P_k + G_k + template tokens from the end-of-turn of assistant turn k onward

where k is the last assistant message with token fields. Only that suffix is ever tokenized.

Two levels:

- ``splice_token_ids``: the id-level rule (TE-01), including what to do with the end-of-turn EOS.
- ``find_turn_suffix``: where turn k ends in the template's rendering, found with a sentinel.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gymserve.errors import InvalidRequestError, SpliceError
from gymserve.protocol import TRAINING_FIELDS, TokenInfo, get_token_info


def splice_token_ids(
    prev_prompt_ids: Sequence[int],
    prev_generation_ids: Sequence[int],
    template_suffix_ids: Sequence[int],
    eos_token_ids: Sequence[int],
) -> list[int]:
    """The spliced prompt: ``P + G + suffix``, with exactly one EOS closing the spliced turn.

    ``template_suffix_ids`` are the template's tokens starting AT the EOS (end-of-turn token) that
    closes assistant turn k, through the end of the new prompt (generation prompt included).
    ``eos_token_ids``: every ID that ends a turn (a model may have several, e.g. Qwen's 151645
    ``<|im_end|>`` and 151643 ``<|endoftext|>``).

    Rule (TE-01): when G ends with any EOS id, the model closed the turn itself: its own EOS stays
    and the template's leading EOS is dropped (scenario C: ``[..., 26, 9, 3, ...]``, never
    ``[..., 9, 2, ...]``). That is the usual case: gymserve (like vLLM) returns G with the EOS it
    sampled, so the next prompt holds the model's own EOS, the token it has a log-prob for.
    Otherwise (the turn was cut off by ``max_tokens``, ended on a ``stop_token_ids`` token that is
    not an EOS, or a client sent G without its EOS) the template's EOS is kept (scenarios A-trimmed
    and B): then it is part of the prompt, never of the generation, has no log-prob and is not
    trained on.

    Differs from NeMo RL's ``_replace_prefix_tokens`` (vLLM worker), which re-renders and
    re-tokenizes the whole conversation twice (up to turn k, and all of it), takes the last EOS
    token inside the re-tokenized prefix as the boundary, and compares against one
    ``eos_token_id``: it strips the model's EOS only when it is that id and then always uses the
    template's. So a model that ended with another EOS id either gets a double EOS or has its
    sampled EOS replaced (``prompt[:len(P+G)] != P+G``, scenario C; later versions accept several
    EOS ids and keep the model's EOS, as here), the boundary depends on how the re-tokenized text
    lines up, and each turn costs a tokenization of the whole history. Here the
    boundary comes from the template's text structure (``find_turn_suffix``), only the suffix is
    tokenized, and the model's tokens are never replaced.

    Returns a new list. Raises ``SpliceError`` when the suffix does not start with an EOS id.
    """
    eos = set(eos_token_ids)
    if not template_suffix_ids or template_suffix_ids[0] not in eos:
        raise SpliceError(
            "the template's tokens after the spliced assistant turn must start with its end-of-turn "
            f"token (one of {sorted(eos)}), got {list(template_suffix_ids[:1])}; the chat template "
            "and the model's EOS ids disagree"
        )
    out = list(prev_prompt_ids)
    out.extend(prev_generation_ids)
    if prev_generation_ids and prev_generation_ids[-1] in eos:
        out.extend(template_suffix_ids[1:])
    else:
        out.extend(template_suffix_ids)
    return out


def find_spliced_turn(messages: Sequence[Mapping[str, Any]], vocab_size: int) -> tuple[int, TokenInfo] | None:
    """The index k of the last message carrying token fields and its validated ``TokenInfo``, or None.

    Raises ``SpliceError`` when a message that is not an assistant message carries token fields
    (only the model's own turns have a prompt and a generation), and ``InvalidRequestError`` (param
    ``messages[k].<field>``) when the fields of message k are partial, malformed, or hold IDs outside
    ``[0, vocab_size)``. Earlier assistant messages' token fields are ignored (P_k already holds
    them) and not re-validated: that keeps the cost independent of the number of turns.
    """
    k = None
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            continue  # prepare_messages reports it with its index
        present = [f for f in TRAINING_FIELDS if msg.get(f) is not None]
        if not present:
            continue
        if msg.get("role") != "assistant":
            raise SpliceError(
                f"messages[{i}] has role {msg.get('role')!r} but carries {', '.join(present)}; only "
                "assistant messages (the model's own turns) may carry token fields"
            )
        k = i
    if k is None:
        return None
    msg = messages[k]
    try:
        info = get_token_info(msg)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"messages[{k}]: {e.message}", param=f"messages[{k}].{e.param}") from e
    assert info is not None
    for name in ("prompt_token_ids", "generation_token_ids"):
        ids = info[name]
        if ids and max(ids) >= vocab_size:
            bad = next(t for t in ids if t >= vocab_size)
            raise InvalidRequestError(
                f"messages[{k}].{name} holds token id {bad}, outside the model's vocabulary "
                f"[0, {vocab_size}); send back the ids this model returned",
                param=f"messages[{k}].{name}",
            )
    if not info["prompt_token_ids"]:
        raise InvalidRequestError(
            f"messages[{k}].prompt_token_ids is empty; a model call always has a prompt",
            param=f"messages[{k}].prompt_token_ids",
        )
    return k, info


@dataclass
class TurnSuffix:
    """Where assistant turn k ends in the template's rendering of the new prompt.

    ``text``: the rendered prompt from the end-of-turn token of turn k (included) to the end,
    generation prompt included. ``token_ids``: ``text`` tokenized on its own, starting with an EOS id.
    """

    text: str
    token_ids: list[int]


def find_turn_suffix(
    template: Any,
    messages: Sequence[Mapping[str, Any]],
    k: int,
    tools: Sequence[Mapping[str, Any]] | None,
    kwargs: Mapping[str, Any] | None,
    eos_token_ids: Sequence[int],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> TurnSuffix:
    """The template's text and tokens after assistant turn ``k`` of prepared ``messages``.

    ``template`` is a ``ChatTemplate``; ``messages`` are already prepared (``prepare_messages``).
    Two renders, both with turn k's content replaced by a random sentinel S:

    - A = messages[:k] + [turn k], no generation prompt: ``closing`` = what A renders after S (tool
      calls, end of turn).
    - B = A's messages + messages[k+1:], with the generation prompt (``add_generation_prompt``;
      or the final message left open, ``continue_final_message``): the new prompt's text.

    B must contain S exactly once, followed by ``closing`` at least through the end-of-turn token:
    the turn's end is the LAST EOS text inside the common prefix of ``closing`` and what follows S
    in B. (Requiring all of ``closing`` would be stricter than needed: a template may end the
    conversation differently from how it separates turns, e.g. an end-of-text marker after the
    final message; what follows the EOS is taken from B, the real new prompt, either way.)
    The suffix is B from that EOS on.

    The sentinel sits in ``content`` because templates render the turn header and reasoning
    (which Qwen3-style templates strip from earlier turns) before content, so only the stable part
    of the turn follows it. Tokenizing only the suffix is exact because it starts with a special token,
    at which the tokenizer splits text: the tokens after it do not depend on what precedes it.

    Raises ``SpliceError`` when the boundary cannot be found unambiguously; never falls back to
    re-tokenized text.
    """
    sentinel = "gymserve-sentinel-" + uuid.uuid4().hex
    turn = dict(messages[k])
    turn["content"] = sentinel
    head = list(messages[:k]) + [turn]
    text_a = template.render_text(head, tools, kwargs, add_generation_prompt=False)
    text_b = template.render_text(
        head + list(messages[k + 1 :]),
        tools,
        kwargs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )

    where = f"the end of assistant turn messages[{k}]"
    if text_a.count(sentinel) != 1:
        raise SpliceError(
            f"cannot find {where}: the chat template renders the assistant's content "
            f"{text_a.count(sentinel)} times instead of once, so the turn boundary is ambiguous"
        )
    closing = text_a[text_a.index(sentinel) + len(sentinel) :]
    tokenizer = template.tokenizer
    eos_texts = {t for t in tokenizer.convert_ids_to_tokens(list(eos_token_ids)) if t}
    if not any(t in closing for t in eos_texts):
        raise SpliceError(
            f"cannot find {where}: the chat template renders no end-of-turn token "
            f"({', '.join(sorted(eos_texts))}) after an assistant turn; configure eos_token_ids to "
            "include the token that closes assistant turns in this template"
        )
    if text_b.count(sentinel) != 1:
        raise SpliceError(
            f"cannot find {where} unambiguously: the template renders it differently when later "
            f"messages follow (its content appears {text_b.count(sentinel)} times instead of once)"
        )
    after_b = text_b.index(sentinel) + len(sentinel)
    # Only the part of `closing` that B renders too counts: A may end the conversation with
    # something B does not have (a trailing newline, an end-of-text marker), while the turn's own
    # closing (tool calls, end-of-turn token) must be rendered identically in both.
    same = len(os.path.commonprefix([closing, text_b[after_b : after_b + len(closing)]]))
    cut = max((closing.rfind(t, 0, same) for t in eos_texts), default=-1)
    if cut < 0:
        raise SpliceError(
            f"cannot find {where} unambiguously: the template renders it differently when later "
            "messages follow than when it is the last message, so the tokens after the model's "
            "generation are not known; use a template that renders past assistant turns the same way"
        )
    p_eos = after_b + cut
    suffix_text = text_b[p_eos:]
    ids = template.encode(suffix_text)
    if not ids or ids[0] not in set(eos_token_ids):
        raise SpliceError(
            f"cannot splice after {where}: its end-of-turn text does not tokenize to an EOS id "
            f"(got {ids[:1]}, expected one of {sorted(set(eos_token_ids))})"
        )
    return TurnSuffix(text=suffix_text, token_ids=ids)
