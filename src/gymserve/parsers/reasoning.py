"""Reasoning parsers: split ``<think>…</think>`` reasoning from the rest of a generation.

Named as ``vllm serve --reasoning-parser`` names them (``deepseek_r1``, ``qwen3``). Both use the
same tags and, here, the same rule (``wire.think.split_span``); vLLM's two parsers differ only in
how they guess what that rule decides from the real prompt tail and the finish reason.
"""

from __future__ import annotations

from gymserve.parsers.base import ReasoningParser
from gymserve.wire import think


class ThinkReasoningParser(ReasoningParser):
    """``<think>reasoning</think>answer`` with the opening tag either generated or pre-filled.

    The rule (``split``; implemented by ``wire.think.split_span``, the one owner of the tags and of
    how text is split on them):

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

    open_tag = think.OPEN
    close_tag = think.CLOSE

    def split(self, text: str, prompt_tail: str, finish_reason: str | None) -> tuple[str | None, str, bool]:
        """``(reasoning, rest, incomplete)`` of a finished generation (``wire.think.split_span``)."""
        return think.split_span(text, prompt_tail, finish_reason)

    def open_body(self, text: str, prompt_tail: str, search_from: int = 0) -> int | None:
        """Where the reasoning starts while a span the model opened itself is still open (its text
        is reasoning however the generation ends), else None."""
        return think.open_span_body(text, prompt_tail, search_from)

    def split_partial(self, text: str, prompt_tail: str, search_from: int = 0) -> tuple[str | None, str] | None:
        """``(reasoning, rest)`` once ``text`` decides the span (it has no span, or ``</think>``
        closed it), else None: an unclosed span waits for the finish reason."""
        return think.split_span_partial(text, prompt_tail, search_from)


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
