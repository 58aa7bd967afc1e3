"""What one local engine call sends back: ``ChatCompletionChunk`` dicts, decided as it generates.

:class:`CallOutput` owns every rule about a call's output, streamed or not:

- the text: the streaming parsers (``parsers.streaming``) turn decoded text into reasoning, content
  and tool-call deltas, each sent only once later text cannot change it, so the concatenated stream
  equals the whole-text parse;
- the sampled stop token: the EOS or stop token that ended the generation is a training token — it
  stays in ``generation_token_ids`` with its log-prob, in ``logprobs.content`` and in usage, as vLLM
  returns it (``token_ids``) — but not in the text, which shows only the tokens before it (vLLM's
  text does not show it either); the prefix splice keeps it as the turn's end (``prompting.splice``);
- the finish reason: ``abort`` for a call ended by ``POST /pause?mode=abort`` (vLLM's value),
  ``length`` when generation stopped at the limit or inside the reasoning span, else
  ``tool_calls`` when calls were parsed, else ``stop``;
- log-probs: ``choices[].logprobs`` in the OpenAI shape (vLLM's ``return_tokens_as_token_ids``
  spelling honoured), on the finish chunk;
- vLLM's ``return_token_ids`` (``LocalCall.return_token_ids``), in vLLM's places on a stream
  (``serving_chat.py``'s ``chat_completion_stream_generator``): the first chunk carries the
  top-level ``prompt_token_ids``, and each engine step's tokens ride as ``choices[0].token_ids`` on
  the first chunk that step produces (a chunk with an empty delta when it produces no text), the
  last step's on the finish chunk: concatenated, they are the generation, its stop token included.
  The whole answer's ``prompt_token_ids`` and ``choices[].token_ids`` are set by the backend;
- the training fields (``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``) and
  the weight version(s) that sampled them (``control.version_fields``) on the finish chunk's delta,
  and usage (every sampled token counted, the stop token included).

The non-streamed answer is :meth:`CallOutput.whole`: the same chunks for the finished generation.
"""

from __future__ import annotations

import time
from typing import Any

from gymserve.backends.local.control import version_fields
from gymserve.backends.local.request import LocalCall
from gymserve.engine.base import Generation, PromptLogprobs
from gymserve.engine.ending import cut_at_hit
from gymserve.parsers import ChatDeltas, ReasoningParser, StreamingParser, ToolCallParser


class CallOutput:
    """The chunks of one prepared call (``request.LocalCall``); see the module docstring.

    Use: :meth:`role` first, :meth:`text` for each piece of final text as it is decoded, then
    :meth:`end` with the finished ``engine.base.Generation``; or :meth:`whole` for all at once.
    ``chunk_id`` names every chunk (``chatcmpl-…``); ``reasoning_field`` is the delta field that
    carries reasoning (``reasoning_content`` or ``reasoning``); ``engine`` is asked for its weight
    version when a generation reports none per token. ``index``: the choice these chunks belong to
    (``n > 1``: one ``CallOutput`` per choice).
    """

    def __init__(
        self,
        call: LocalCall,
        *,
        tokenizer: Any,
        model: str,
        chunk_id: str,
        tool_parser: ToolCallParser | None,
        reasoning_parser: ReasoningParser | None,
        reasoning_field: str,
        stop_token_ids: tuple[int, ...] | frozenset[int],
        engine: Any = None,
        index: int = 0,
    ):
        self.call = call
        self.tokenizer = tokenizer
        self.engine = engine
        self.stop_token_ids = stop_token_ids
        self.index = index
        self.sampled = 0  # tokens the engine sampled for this choice (usage), known at end()
        self.ids_sent = 0  # generation tokens already sent as choices[0].token_ids (return_token_ids)
        self.stop_reason: int | str | None = None  # vLLM's, known at end()
        self.prompt_logprobs: PromptLogprobs | None = None  # when the call asked for them, at end()
        self._head = {"id": chunk_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
        self._parser = ChatDeltas(
            # No tools to parse calls for (tool_choice "none"): the parser still reads a channel
            # format's framing (harmony), it just finds no calls.
            StreamingParser(
                tool_parser, reasoning_parser, call.prompt.text_tail, call.tools if call.parse_tools else None
            ),
            (reasoning_field,),
        )

    # ---- chunks ----------------------------------------------------------------------------

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            **self._head,
            "choices": [{"index": self.index, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }

    def role(self) -> dict[str, Any]:
        """The first chunk: ``{"role": "assistant", "content": ""}`` (and, with ``return_token_ids``,
        the top-level ``prompt_token_ids``, as vLLM's first chunk)."""
        chunk = self._chunk({"role": "assistant", "content": ""})
        if self.call.return_token_ids:
            chunk["prompt_token_ids"] = self.call.prompt.token_ids
        return chunk

    def text(self, text: str) -> list[dict[str, Any]]:
        """Chunks for the next piece of generated text (none while the parsers hold it back)."""
        return [self._chunk(delta) for delta in self._parser.feed(text)]

    def step(self, ids: list[int], text: str) -> list[dict[str, Any]]:
        """Chunks for one engine step: ``ids`` sampled, ``text`` their final text (``text``), with the
        step's ``token_ids`` when the call asked for them (module docstring)."""
        chunks = self.text(text)
        if self.call.return_token_ids:
            self.ids_sent += len(ids)
            chunks = with_token_ids(chunks, ids, lambda: self._chunk({}))
        return chunks

    def text_ids(self, gen: Generation) -> list[int]:
        """The tokens of ``gen`` whose text is shown (see module docstring)."""
        return text_ids(gen, self.stop_token_ids)

    def end(self, gen: Generation, tail_text: str, *, include_usage: bool) -> list[dict[str, Any]]:
        """The last chunks: ``tail_text`` (the text of :meth:`text_ids` not yet passed to
        :meth:`text`) parsed, the parsers' last deltas, the finish chunk (training fields on its
        delta, log-probs when asked) and, with ``include_usage``, the usage chunk (``choices: []``)."""
        self.sampled = len(gen.token_ids)
        self.stop_reason = gen.stop_reason
        self.prompt_logprobs = gen.prompt_logprobs
        out = self.text(tail_text) + [self._chunk(d) for d in self._parser.finish(gen.finish_reason)]
        final = self._chunk(
            {
                "prompt_token_ids": self.call.prompt.token_ids,
                "generation_token_ids": gen.token_ids,
                "generation_log_probs": gen.log_probs,
                **version_fields(gen, self.engine),
            },
            self._finish_reason(gen.finish_reason),
        )
        final["choices"][0]["stop_reason"] = gen.stop_reason
        if self.call.logprobs:
            final["choices"][0]["logprobs"] = self._logprobs(gen)
        if self.call.return_token_ids:
            final["choices"][0]["token_ids"] = gen.token_ids[self.ids_sent :]
        out.append(final)
        if include_usage:
            prompt, completion = len(self.call.prompt.token_ids), len(gen.token_ids)
            out.append(
                {
                    **self._head,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": prompt,
                        "completion_tokens": completion,
                        "total_tokens": prompt + completion,
                    },
                }
            )
        return out

    def whole(self, gen: Generation) -> list[dict[str, Any]]:
        """Every chunk of a finished generation, usage included, as a stream would have sent them
        (the parsers' result does not depend on how the text is split)."""
        text = self.tokenizer.decode(self.text_ids(gen), skip_special_tokens=False)
        if isinstance(gen.stop_reason, str):
            text = cut_at_hit(text, gen.stop_reason, include=self.call.sampling.include_stop_str_in_output)
        return [self.role(), *self.end(gen, text, include_usage=True)]

    # ---- rules -----------------------------------------------------------------------------

    def _finish_reason(self, engine_finish: str) -> str:
        if engine_finish == "abort":
            return "abort"
        if engine_finish == "length" or self._parser.reasoning_incomplete:
            return "length"
        return "tool_calls" if self._parser.call_ids else "stop"

    def _token(self, tid: int) -> str:
        if self.call.tokens_as_ids:
            return f"token_id:{tid}"
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _logprobs(self, gen: Generation) -> dict[str, Any]:
        content = []
        for i, (tid, lp) in enumerate(zip(gen.token_ids, gen.log_probs)):
            token = self._token(tid)
            alternatives = gen.top_logprobs[i] if i < len(gen.top_logprobs) else []
            top = [
                {"token": self._token(a), "logprob": alp, "bytes": list(self._token(a).encode())}
                for a, alp in alternatives
            ]
            content.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": top})
        return {"content": content, "refusal": None}


def with_token_ids(chunks: list[dict[str, Any]], ids: list[int], empty: Any) -> list[dict[str, Any]]:
    """``chunks`` with ``ids`` as the first one's ``choices[0].token_ids`` (vLLM's ``return_token_ids``
    placement: one engine step's tokens on the chunk that step produced); ``empty()`` makes a chunk
    to carry them when the step produced none. No ``ids``: ``chunks`` unchanged."""
    if not ids:
        return chunks
    if not chunks:
        chunks = [empty()]
    chunks[0]["choices"][0]["token_ids"] = list(ids)
    return chunks


def text_ids(gen: Generation, stop_token_ids: tuple[int, ...] | frozenset[int]) -> list[int]:
    """The tokens of ``gen`` whose text an answer shows: all of them but the EOS/stop token that ended
    a ``stop`` generation (``stop_token_ids``: the call's stop set, ``engine.ending.Ending.stop_ids``).
    That token stays a training token (``generation_token_ids``, its log-prob, usage) on every route;
    only its text is not shown, as vLLM's text does not show it (its detokenizer skips the EOS; a
    ``stop_token_ids`` match is left out of the text likewise). A generation a stop string ended
    shows every token's text, cut at the string (``engine.ending``)."""
    ids = gen.token_ids
    if gen.finish_reason == "stop" and not isinstance(gen.stop_reason, str) and ids and ids[-1] in stop_token_ids:
        return ids[:-1]
    return ids
