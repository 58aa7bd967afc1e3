"""Reasoning parsers: split ``<think>…</think>`` reasoning from the rest of a generation.

Named as ``vllm serve --reasoning-parser`` names them (``deepseek_r1``, ``qwen3``). Both use the
same tags and, here, the same rule (see :class:`ThinkReasoningParser`); vLLM's two parsers differ
only in how they guess what this module decides from the real prompt tail and the finish reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gymserve.parsers.base import ReasoningParser

_LEADING_SPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class _Span:
    """Where the reasoning span lies in a text: ``body`` is where its text starts; ``close`` the
    index of the closing tag (None: not closed yet); ``rest`` where the text after it starts.
    ``body is None`` means there is no reasoning span at all."""

    body: int | None
    close: int | None = None
    rest: int = 0


class ThinkReasoningParser(ReasoningParser):
    """``<think>reasoning</think>answer`` with the opening tag either generated or pre-filled.

    The rule (``split``):

    1. The span opens if the generation starts (after whitespace) with ``<think>``, or if the
       prompt tail ends (ignoring whitespace) with an open ``<think>`` — templates of thinking
       models pre-fill it, so the model emits only ``</think>`` (case RP-01). An empty
       ``prompt_tail`` means "prompt unknown" (a chat server that returns only text) and is
       treated like a pre-filled ``<think>``: a lone ``</think>`` still closes a span. A tail
       ending in ``</think>`` (Qwen3 with thinking disabled) does not open one.
    2. The span ends at the first ``</think>``: reasoning is the text before it, the rest is the
       text after it; tags and the whitespace next to them are stripped; empty reasoning is None.
    3. A span that never closes: if the model opened it itself, it is reasoning (``incomplete``
       when ``finish_reason`` is ``"length"``) — the model said it was thinking, and this is what
       lets that reasoning stream as it is generated. If the prompt pre-filled it, the finish
       reason decides: ``"length"`` means generation was cut mid-thought, so the text is reasoning
       and ``incomplete`` is True; any other reason (``"stop"``: the model emitted EOS) means the
       model skipped thinking and answered, so the text is content (case RP-04). vLLM's ``qwen3``
       parser differs: it returns an unclosed pre-filled span as reasoning whatever the finish
       reason, which turns a complete short answer into reasoning and leaves the content empty.
    4. No span: reasoning is None and the whole text is the rest.

    Tags elsewhere (a second ``<think>`` block, a ``<think>`` inside reasoning) stay verbatim.
    """

    open_tag = "<think>"
    close_tag = "</think>"

    def _opens_in_prompt(self, prompt_tail: str | None) -> bool:
        return not prompt_tail or prompt_tail.rstrip().endswith(self.open_tag)

    def _locate(self, text: str, prompt_tail: str | None, final: bool, search_from: int = 0) -> _Span | None:
        """The span, or None while a prefix of ``<think>`` could still open it. ``search_from``:
        the caller knows ``</think>`` does not start before it (streaming: no rescans)."""
        # No lstrip(): streaming calls this on every delta of a long text, so avoid copying it.
        lead = _LEADING_SPACE.match(text).end()  # type: ignore[union-attr]
        if text.startswith(self.open_tag, lead):
            body = lead + len(self.open_tag)
        elif not final and self.open_tag.startswith(text[lead : lead + len(self.open_tag)]):
            return None
        elif self._opens_in_prompt(prompt_tail):
            body = 0
        else:
            return _Span(body=None)
        close = text.find(self.close_tag, max(body, search_from))
        if close < 0:
            return _Span(body=body)
        return _Span(body=body, close=close, rest=close + len(self.close_tag))

    def split(self, text: str, prompt_tail: str, finish_reason: str | None) -> tuple[str | None, str, bool]:
        """``(reasoning, rest, incomplete)`` of a finished generation; see the class docstring."""
        span = self._locate(text, prompt_tail, final=True)
        assert span is not None  # final=True always decides
        if span.body is None:
            return None, text, False
        if span.close is None:
            cut = finish_reason in ("length", "abort")  # stopped by the limit, or by POST /pause?mode=abort
            if cut or span.body > 0:  # cut mid-thought, or opened by the model
                return text[span.body :].strip() or None, "", cut
            return None, text[span.body :].lstrip(), False
        return text[span.body : span.close].strip() or None, text[span.rest :].lstrip(), False

    def open_body(self, text: str, prompt_tail: str, search_from: int = 0) -> int | None:
        """Where the reasoning starts while a span the model opened itself is still open (its text
        is reasoning however the generation ends), else None."""
        span = self._locate(text, prompt_tail, final=False, search_from=search_from)
        if span is None or span.body is None or span.close is not None or span.body == 0:
            return None
        return span.body

    def split_partial(self, text: str, prompt_tail: str, search_from: int = 0) -> tuple[str | None, str] | None:
        """``(reasoning, rest)`` once ``text`` decides the span (it has no span, or ``</think>``
        closed it), else None: an unclosed span waits for the finish reason."""
        span = self._locate(text, prompt_tail, final=False, search_from=search_from)
        if span is None:
            return None
        if span.body is None:
            return None, text
        if span.close is None:
            return None
        return text[span.body : span.close].strip() or None, text[span.rest :].lstrip()


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1 (and its distills): ``<think>…</think>``; newer R1 templates pre-fill ``<think>\\n``.

    Source: DeepSeek-R1 model card / chat template; vLLM ``--reasoning-parser deepseek_r1``.
    """

    name = "deepseek_r1"


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3 (and QwQ): ``<think>…</think>``; with ``enable_thinking=False`` the template pre-fills
    an empty ``<think>\\n\\n</think>\\n\\n``, which opens no span here.

    Source: Qwen3 model card / chat template; vLLM ``--reasoning-parser qwen3`` (whose handling of an
    unclosed span differs, see :class:`ThinkReasoningParser`).
    """

    name = "qwen3"
