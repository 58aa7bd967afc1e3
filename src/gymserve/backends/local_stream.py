"""Streaming for the local backend: engine token deltas → incremental detokenization → the
streaming parsers → ``ChatCompletionChunk`` dicts.

The parsers emit a delta only once later text cannot change it, so the concatenated stream equals
the non-streamed answer for the same tokens; the training fields ride on the final chunk's delta.
Leaving the stream early (client disconnect) closes the engine stream, which cancels generation.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from gymserve.backends.local import chat_finish_reason, usage
from gymserve.backends.local_control import version_fields
from gymserve.backends.local_request import LocalCall


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


class _Chunks:
    """Chunk dicts of one call: the parser's deltas as they are decided, then the final chunk."""

    def __init__(self, backend, call: LocalCall) -> None:
        from gymserve.parsers.streaming import ChatDeltas, StreamingParser

        self.backend, self.call = backend, call
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), backend.served_model_name()
        self.parser = ChatDeltas(StreamingParser(backend.tool_parser if call.parse_tools else None,
                                                 backend.reasoning_parser, call.prompt.text_tail, call.tools),
                                 (backend.config.reasoning_field,))

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    def role(self) -> dict[str, Any]:
        return self.chunk({"role": "assistant", "content": ""})

    def text(self, text: str) -> list[dict[str, Any]]:
        return [self.chunk(delta) for delta in self.parser.feed(text)]

    def end(self, gen, kept: tuple[list[int], list[float], list], tail_text: str) -> list[dict[str, Any]]:
        """The last parsed deltas, the finish chunk (training fields on its delta, log-probs when
        asked) and, with ``stream_options.include_usage``, the usage chunk."""
        ids, lps, tops = kept
        call, backend = self.call, self.backend
        out = self.text(tail_text) + [self.chunk(d) for d in self.parser.finish(gen.finish_reason)]
        reason = chat_finish_reason(gen.finish_reason, self.parser.reasoning_incomplete, bool(self.parser.call_ids))
        final = self.chunk({"prompt_token_ids": call.prompt.token_ids, "generation_token_ids": ids,
                            "generation_log_probs": lps, **version_fields(gen, len(ids), backend.engine)}, reason)
        if call.logprobs:
            final["choices"][0]["logprobs"] = backend._logprobs(call, ids, lps, tops)
        out.append(final)
        if call.include_usage:
            out.append({**{k: v for k, v in final.items() if k != "choices"}, "choices": [],
                        "usage": usage(len(call.prompt.token_ids), len(gen.token_ids))})
        return out


def generation_chunks(backend, call: LocalCall, gen) -> list[dict[str, Any]]:
    """The chunks of a finished generation, as ``stream_chat`` would have sent them (the parsers'
    result does not depend on how the text is split): what the non-streamed Responses answer is
    built from, so it equals the streamed one."""
    chunks = _Chunks(backend, call)
    kept = backend._trim(gen)
    return [chunks.role(), *chunks.end(gen, kept, backend.tokenizer.decode(kept[0], skip_special_tokens=False))]


async def stream_chat(backend, call: LocalCall) -> AsyncIterator[dict[str, Any]]:
    """Yield chat chunks for one prepared local call (see module docstring)."""
    from gymserve.engine.base import Generation, extend_spans

    chunks = _Chunks(backend, call)
    detok = IncrementalDetokenizer(backend.tokenizer)
    ids: list[int] = []
    lps: list[float] = []
    tops: list = []
    spans: list = []
    yield chunks.role()
    finish = "length"
    stream = backend.engine.stream(call.prompt.token_ids, call.sampling)
    try:
        async for step in stream:
            extend_spans(spans, step.weight_version, len(ids), len(step.token_ids))
            ids += step.token_ids
            lps += step.log_probs
            tops += step.top_logprobs
            if step.finish_reason:
                finish = step.finish_reason
                break
            for c in chunks.text(detok.push(step.token_ids)):
                yield c
    finally:
        await stream.aclose()
    gen = Generation(ids, lps, finish, tops, spans)
    kept = backend._trim(gen)
    for c in chunks.end(gen, kept, detok.push(kept[0][len(detok.ids):], final=True)):
        yield c
