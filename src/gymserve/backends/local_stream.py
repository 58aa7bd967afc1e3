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
from gymserve.backends.local_request import LocalCall


class IncrementalDetokenizer:
    """Text of a growing token sequence, emitted only where it is final.

    Decoding the whole sequence each step is simple and exact (a token can change how the previous
    bytes decode); text ending in U+FFFD (an incomplete UTF-8 sequence) waits for the next token.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        if not final and text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[self.emitted:], len(text)
        return new


def _chunk(cid: str, created: int, model: str, delta: dict[str, Any], finish: str | None = None,
           **extra: Any) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}


async def stream_chat(backend, call: LocalCall) -> AsyncIterator[dict[str, Any]]:
    """Yield chat chunks for one prepared local call (see module docstring)."""
    from gymserve.parsers.streaming import ChatDeltas, StreamingParser

    cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), backend.engine.model_name
    parser = ChatDeltas(StreamingParser(backend.tool_parser if call.parse_tools else None, backend.reasoning_parser,
                                        call.prompt.text_tail, call.tools), (backend.config.reasoning_field,))
    detok = IncrementalDetokenizer(backend.tokenizer)
    ids: list[int] = []
    lps: list[float] = []
    tops: list = []
    yield _chunk(cid, created, model, {"role": "assistant", "content": ""})

    def to_chunks(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [_chunk(cid, created, model, delta) for delta in deltas]

    finish = "length"
    stream = backend.engine.stream(call.prompt.token_ids, call.sampling)
    try:
        async for step in stream:
            ids += step.token_ids
            lps += step.log_probs
            tops += step.top_logprobs
            if step.finish_reason:
                finish = step.finish_reason
                break
            for c in to_chunks(parser.feed(detok.push(step.token_ids))):
                yield c
    finally:
        await stream.aclose()
    from gymserve.engine.base import Generation

    gen = Generation(ids, lps, finish, tops)
    kept, kept_lps, kept_tops = backend._trim(gen)
    tail_ids = kept[len(detok.ids):]
    deltas = parser.feed(detok.push(tail_ids, final=True)) + parser.finish(finish)
    for c in to_chunks(deltas):
        yield c
    reason = chat_finish_reason(finish, parser.reasoning_incomplete, bool(parser.call_ids))
    last = {"prompt_token_ids": call.prompt.token_ids, "generation_token_ids": kept,
            "generation_log_probs": kept_lps}
    final = _chunk(cid, created, model, last, reason)
    if call.logprobs:
        final["choices"][0]["logprobs"] = backend._logprobs(call, kept, kept_lps, kept_tops)
    yield final
    if call.include_usage:
        yield {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": usage(len(call.prompt.token_ids), len(ids))}
