"""Streaming for the local backend: engine token deltas → incremental detokenization →
``output.CallOutput`` → ``ChatCompletionChunk`` dicts.

Text is passed on only where it is final (see :class:`IncrementalDetokenizer`); the parsers in
``CallOutput`` then send a delta only once later text cannot change it, so the concatenated stream
equals the non-streamed answer for the same tokens. Leaving the stream early (client disconnect)
closes the engine stream, which cancels generation.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

from gymserve.backends.local.output import CallOutput
from gymserve.engine.base import Engine, FinishReason, Generation, SamplingParams, extend_spans


class IncrementalDetokenizer:
    """Text of a growing token sequence, emitted only where it is final, in O(1) decode work per
    token.

    Each step decodes a short window: the tokens from ``prefix`` on, against the same window
    without the new tokens (``prefix:read``); the difference is the new text. Starting the window a
    few tokens back keeps context-dependent decoding right (SentencePiece drops the leading space of
    a sequence's first token; both decodes drop it alike). Text ending in U+FFFD (an incomplete
    UTF-8 sequence) waits for the next token. The scheme is the one vLLM and TGI use; the pieces
    concatenate to ``decode(ids)`` (tested against it).
    """

    def __init__(self, tokenizer, window: int = 6):
        self.tokenizer = tokenizer
        self.window = window
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens up to here have been emitted as text

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=False)
        after = decode(self.ids[self.prefix :], skip_special_tokens=False)
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""
        self.read = len(self.ids)
        self.prefix = max(self.prefix, self.read - self.window)
        return after[len(before) :]


async def stream_chunks(
    engine: Engine,
    output: CallOutput | Any,
    prompt_ids: Sequence[int],
    sampling: SamplingParams,
    *,
    include_usage: bool,
) -> AsyncGenerator[dict[str, Any], None]:
    """Generate one choice (``prompt_ids`` under ``sampling``) on ``engine`` and yield its chunks as
    the tokens arrive.

    ``output`` shapes the chunks: a chat ``CallOutput``, or anything with its methods (``role()``,
    ``step(ids, text)``, ``text_ids(gen)``, ``end(gen, tail, include_usage=)``) and a ``tokenizer`` — the
    completions route's ``CompletionOutput``. A stream that ends without a finish reason counts as
    ``length``."""
    detok = IncrementalDetokenizer(output.tokenizer)
    ids: list[int] = []
    lps: list[float] = []
    tops: list = []
    spans: list = []  # weight versions over the tokens (engine.base.extend_spans)
    prompt_logprobs = None  # on the first delta when the call asked for them
    yield output.role()
    finish: FinishReason = "length"
    stream = engine.stream(prompt_ids, sampling)
    try:
        async for step in stream:
            extend_spans(spans, step.weight_version, len(ids), len(step.token_ids))
            ids += step.token_ids
            lps += step.log_probs
            tops += step.top_logprobs
            prompt_logprobs = prompt_logprobs or step.prompt_logprobs
            if step.finish_reason:
                finish = step.finish_reason
                break
            for chunk in output.step(step.token_ids, detok.push(step.token_ids)):
                yield chunk
    finally:
        await stream.aclose()
    gen = Generation(ids, lps, finish, tops, spans, prompt_logprobs)
    tail = detok.push(output.text_ids(gen)[len(detok.ids) :], final=True)
    for chunk in output.end(gen, tail, include_usage=include_usage):
        yield chunk
