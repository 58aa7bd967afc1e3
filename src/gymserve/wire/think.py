"""The ``<think>`` tags and the two ways text is split on them, in one place.

Two questions, two rules, one set of tags and one whitespace rule (tags and the whitespace next to
them are stripped; empty reasoning is None):

- **a generation's reasoning span** (``split_span``, ``locate_span``): what the model just wrote,
  decided with the real prompt tail and the finish reason — the reasoning parsers' rule
  (``parsers.reasoning``): only a span at the start (or pre-filled by the template) is reasoning,
  and later tags stay verbatim;
- **think blocks in a message's content** (``split_think``): content that reached the converter
  with its tags still in (a chat server run without a reasoning parser, a history written with
  ``reasoning_mode: think_tags``): every block is reasoning, wherever it is.

``think_block`` writes reasoning back as tags (``reasoning_mode: think_tags``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gymserve.text import partial_tag_len

OPEN, CLOSE = "<think>", "</think>"
_LEADING_SPACE = re.compile(r"\s*")


def think_block(reasoning: str) -> str:
    """``reasoning`` as the block a template or server reads back: ``<think>\\n…\\n</think>\\n\\n``."""
    return f"{OPEN}\n{reasoning}\n{CLOSE}\n\n"


# -- think blocks in a message's content ------------------------------------------------------


def split_think(content: str, *, final: bool = True) -> list[tuple[str, str]]:
    """Split assistant content into ordered ``("reasoning" | "text", text)`` segments.

    Every ``<think>…</think>`` block becomes a reasoning segment (tags and whitespace next to them
    stripped); an unclosed ``<think>`` at the end (a length-truncated turn) is reasoning too. Empty
    segments are dropped; text pieces separated only by an empty block are merged.

    ``final=False`` is the streaming view of a prefix of the content: it withholds what later text
    could still change (a partial tag, trailing whitespace that a following tag would strip), so
    each segment it returns is a prefix of the same segment of the final split.
    """
    raw: list[tuple[str, str]] = []
    pos, in_think, after_tag = 0, False, False
    while True:
        kind = "reasoning" if in_think else "text"
        tag = CLOSE if in_think else OPEN
        j = content.find(tag, pos)
        if j < 0:
            piece = content[pos:]
            if not final:
                piece = piece[: len(piece) - partial_tag_len(piece, tag)].rstrip()
            elif in_think:
                piece = piece.rstrip()
            raw.append((kind, piece.lstrip() if after_tag else piece))
            break
        piece = content[pos:j].rstrip()
        raw.append((kind, piece.lstrip() if after_tag else piece))
        pos, in_think, after_tag = j + len(tag), not in_think, True
    merged: list[tuple[str, str]] = []
    for kind, text in raw:
        if not text.strip():
            continue
        if kind == "text" and merged and merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + text)
        else:
            merged.append((kind, text))
    return merged


# -- a generation's reasoning span ------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """Where the reasoning span lies in a text: ``body`` is where its text starts; ``close`` the
    index of the closing tag (None: not closed yet); ``rest`` where the text after it starts.
    ``body is None`` means there is no reasoning span at all."""

    body: int | None
    close: int | None = None
    rest: int = 0


def _opens_in_prompt(prompt_tail: str | None) -> bool:
    return not prompt_tail or prompt_tail.rstrip().endswith(OPEN)


def locate_span(text: str, prompt_tail: str | None, *, final: bool, search_from: int = 0) -> Span | None:
    """The span of ``text`` (see :func:`split_span` for the rule), or None while a prefix of
    ``<think>`` could still open it (``final`` False). ``search_from``: the caller knows
    ``</think>`` does not start before it (streaming: no rescans)."""
    # No lstrip(): streaming calls this on every delta of a long text, so avoid copying it.
    lead = _LEADING_SPACE.match(text).end()  # type: ignore[union-attr]
    if text.startswith(OPEN, lead):
        body = lead + len(OPEN)
    elif not final and OPEN.startswith(text[lead : lead + len(OPEN)]):
        return None
    elif _opens_in_prompt(prompt_tail):
        body = 0
    else:
        return Span(body=None)
    close = text.find(CLOSE, max(body, search_from))
    if close < 0:
        return Span(body=body)
    return Span(body=body, close=close, rest=close + len(CLOSE))


def split_span(text: str, prompt_tail: str, finish_reason: str | None) -> tuple[str | None, str, bool]:
    """``(reasoning, rest, incomplete)`` of a finished generation: the span opens at the start of the
    generation (``<think>``) or in the prompt (a pre-filled ``<think>``; an empty ``prompt_tail``
    counts as one), ends at the first ``</think>``; an unclosed span is reasoning when the model
    opened it or ``finish_reason`` is ``length`` (or ``abort``), else content. The rule in full, with its cases
    (RP-01, RP-04) and where vLLM differs, is documented on ``parsers.reasoning.ThinkReasoningParser``,
    whose rule this is.
    """
    span = locate_span(text, prompt_tail, final=True)
    assert span is not None  # final=True always decides
    if span.body is None:
        return None, text, False
    if span.close is None:
        cut = finish_reason in ("length", "abort")  # stopped by the limit, or by POST /pause?mode=abort
        if cut or span.body > 0:  # cut mid-thought, or opened by the model
            return text[span.body :].strip() or None, "", cut
        return None, text[span.body :].lstrip(), False
    return text[span.body : span.close].strip() or None, text[span.rest :].lstrip(), False


def open_span_body(text: str, prompt_tail: str, search_from: int = 0) -> int | None:
    """Where the reasoning starts while a span the model opened itself is still open (its text is
    reasoning however the generation ends), else None."""
    span = locate_span(text, prompt_tail, final=False, search_from=search_from)
    if span is None or span.body is None or span.close is not None or span.body == 0:
        return None
    return span.body


def split_span_partial(text: str, prompt_tail: str, search_from: int = 0) -> tuple[str | None, str] | None:
    """``(reasoning, rest)`` once ``text`` decides the span (it has no span, or ``</think>``
    closed it), else None: an unclosed span waits for the finish reason."""
    span = locate_span(text, prompt_tail, final=False, search_from=search_from)
    if span is None:
        return None
    if span.body is None:
        return None, text
    if span.close is None:
        return None
    return text[span.body : span.close].strip() or None, text[span.rest :].lstrip()
