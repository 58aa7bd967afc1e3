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
from gymserve.engine.base import Engine, FinishReason, Generation, SamplingParams, collect, extend_spans
from gymserve.engine.ending import StopStrings, stop_reason


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


class TextEnd:
    """The text of one generation as it is sampled, watched for ``sampling.stop`` strings
    (``engine.ending.StopStrings``, armed from the ``min_tokens``-th token on): ``step`` returns the
    text that may be shown after each engine step, ``hit`` the stop string once one is complete."""

    def __init__(self, tokenizer: Any, sampling: SamplingParams):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.sampling = sampling
        stops = sampling.stop
        self.watch = StopStrings(stops, include=sampling.include_stop_str_in_output) if stops else None

    @property
    def hit(self) -> str | None:
        return self.watch.hit if self.watch is not None else None

    def step(self, ids: list[int]) -> str:
        text = self.detok.push(ids)
        if self.watch is None:
            return text
        return self.watch.feed(text, armed=len(self.detok.ids) >= self.sampling.min_tokens)

    def finish(self, gen: Generation, text_ids: list[int]) -> str:
        """The rest of the text of ``gen`` (whose shown tokens are ``text_ids``); a stop string the
        last tokens complete ends ``gen`` with ``stop`` there. Sets ``gen.stop_reason`` (vLLM's)."""
        tail = self.detok.push(text_ids[len(self.detok.ids) :], final=True)
        if self.watch is not None:
            tail = self.watch.feed(tail, armed=len(gen.token_ids) >= self.sampling.min_tokens) + self.watch.flush()
            if self.watch.hit is not None and gen.finish_reason != "abort":
                gen.finish_reason, gen.stop_reason = "stop", self.watch.hit
        return tail


async def generate(engine: Engine, prompt_ids: Sequence[int], sampling: SamplingParams, tokenizer: Any) -> Generation:
    """One whole generation with the local backend's ending rules (``engine.ending``): the engine's
    own (EOS, stop tokens, ``min_tokens``, ``ignore_eos``, length) and the stop strings, which end it
    after the token that completes one (its IDs and log-probs kept whole); ``stop_reason`` set."""
    if not sampling.stop:
        gen = await engine.generate(prompt_ids, sampling)
        gen.stop_reason = stop_reason(gen.token_ids, gen.finish_reason, sampling, engine.eos_token_ids)
        return gen
    text = TextEnd(tokenizer, sampling)
    stream = engine.stream(prompt_ids, sampling)

    async def until_stop():
        async for step in stream:
            yield step
            if step.finish_reason:
                return
            text.step(step.token_ids)
            if text.hit is not None:
                return

    try:
        gen = await collect(until_stop())
    finally:
        await stream.aclose()
    if text.hit is not None:
        gen.finish_reason, gen.stop_reason = "stop", text.hit
    elif gen.finish_reason == "length":
        text.finish(gen, gen.token_ids)
    if gen.stop_reason is None:
        gen.stop_reason = stop_reason(gen.token_ids, gen.finish_reason, sampling, engine.eos_token_ids)
    return gen


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
    text = TextEnd(output.tokenizer, sampling)
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
            for chunk in output.step(step.token_ids, text.step(step.token_ids)):
                yield chunk
            if text.hit is not None:  # a stop string ended it: the engine call is closed below
                finish = "stop"
                break
    finally:
        await stream.aclose()
    gen = Generation(ids, lps, finish, tops, spans, prompt_logprobs, stop_reason=text.hit)
    tail = "" if text.hit is not None else text.finish(gen, output.text_ids(gen))
    if gen.stop_reason is None:
        gen.stop_reason = stop_reason(gen.token_ids, gen.finish_reason, sampling, engine.eos_token_ids)
    for chunk in output.end(gen, tail, include_usage=include_usage):
        yield chunk
