"""Chat Completions chunks folded into one ``ChatCompletion`` (pure, no I/O): what a stream
said, as the non-streamed answer would have said it."""

from __future__ import annotations

import json
import time
from typing import Any

from gymserve.protocol import TRAINING_FIELDS, VERSION_FIELDS, ChatCompletionDict
from gymserve.wire.ids import new_id
from gymserve.wire.reasoning import REASONING_FIELDS, ReasoningField, field_reasoning


class ChunkAccumulator:
    """Folds ``ChatCompletionChunk`` dicts (choice ``index``, 0 by default) into one ``ChatCompletion`` dict.

    Accepts full chunks (``{"id", "model", "choices": [{"delta", "finish_reason"}], "usage"}``) and
    bare choices (``{"delta", "finish_reason"}``). Reasoning comes from ``delta.reasoning_content``
    or ``delta.reasoning`` (one per delta, never both: ``wire.reasoning.field_reasoning``). Training fields may
    ride on the delta, the choice or the chunk: ``prompt_token_ids`` is replaced, the generation
    lists are extended, so both "all on the last chunk" and "per-chunk pieces" servers work.
    """

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.id: str | None = None
        self.model: str | None = None
        self.created: int | None = None
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.refusal: list[str] = []
        self.tool_calls: dict[Any, dict[str, Any]] = {}  # insertion order = order of first appearance
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.tokens: dict[str, list] = {}
        self.versions: dict[str, Any] = {}  # weight_version fields (protocol.VERSION_FIELDS), last one wins
        self.logprobs: list[Any] | None = None  # choices[0].logprobs.content entries, when sent

    def add(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """Fold one chunk; returns what it added: ``{"reasoning", "content", "refusal", "tool_calls":
        [(key, is_new, arguments_delta)]}``."""
        added: dict[str, Any] = {"reasoning": "", "content": "", "refusal": "", "tool_calls": []}
        if not isinstance(chunk, dict):
            return added
        if "choices" not in chunk and "delta" in chunk:
            chunk = {"choices": [chunk]}
        self.id = self.id or chunk.get("id")
        self.model = self.model or chunk.get("model")
        self.created = self.created or chunk.get("created")
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        self._take_tokens(chunk)
        # One choice, by its index (a server streaming n > 1 interleaves the choices).
        choice = next(
            (c for c in chunk.get("choices") or [] if isinstance(c, dict) and c.get("index", 0) == self.index), {}
        )
        self._take_tokens(choice)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            self.logprobs = [*(self.logprobs or ()), *logprobs["content"]]
        raw_delta = choice.get("delta")
        delta: dict[str, Any] = raw_delta if isinstance(raw_delta, dict) else {}
        self._take_tokens(delta)
        reasoning = field_reasoning(delta)
        if reasoning is not None:
            self.reasoning.append(reasoning)
            added["reasoning"] = reasoning
        if isinstance(delta.get("content"), str) and delta["content"]:
            self.content.append(delta["content"])
            added["content"] = delta["content"]
        if isinstance(delta.get("refusal"), str) and delta["refusal"]:
            self.refusal.append(delta["refusal"])
            added["refusal"] = delta["refusal"]
        for pos, tc in enumerate(delta.get("tool_calls") or []):
            if isinstance(tc, dict):
                added["tool_calls"].append(self._take_tool_call(pos, tc))
        return added

    def _take_tool_call(self, pos: int, tc: dict[str, Any]) -> tuple[Any, bool, str]:
        key = tc.get("index", pos)
        raw_function = tc.get("function")
        function: dict[str, Any] = raw_function if isinstance(raw_function, dict) else {}
        is_new = key not in self.tool_calls
        if is_new:
            call_id = tc.get("id")
            if not isinstance(call_id, str) or not call_id or any(c["id"] == call_id for c in self.tool_calls.values()):
                call_id = new_id("call")  # each call needs its own id (the SDK keys function calls by it)
            self.tool_calls[key] = {"id": call_id, "type": "function", "function": {"name": "", "arguments": ""}}
        entry = self.tool_calls[key]["function"]
        if function.get("name") and not entry["name"]:
            entry["name"] = function["name"]
        args = function.get("arguments")
        if isinstance(args, (dict, list)):  # non-standard servers send the object whole
            args = json.dumps(args, ensure_ascii=False)
        if not isinstance(args, str):
            args = ""
        entry["arguments"] += args
        return key, is_new, args

    def _take_tokens(self, obj: dict[str, Any]) -> None:
        for name in TRAINING_FIELDS:
            value = obj.get(name)
            if value is None:
                continue
            if name == "prompt_token_ids" or not isinstance(value, list):
                self.tokens[name] = value
            else:
                self.tokens[name] = [*self.tokens.get(name, []), *value]
        for name in VERSION_FIELDS:
            if name in obj:  # null too: a gateway saying it cannot name the version
                self.versions[name] = obj[name]

    def message_view(self) -> dict[str, Any]:
        """The assistant message so far (reasoning and content only)."""
        return {"content": "".join(self.content), REASONING_FIELDS[0]: "".join(self.reasoning)}

    def completion(self, *, reasoning_field: ReasoningField = REASONING_FIELDS[0]) -> ChatCompletionDict:
        """The accumulated ``ChatCompletion`` dict (``finish_reason`` "stop" if none was sent);
        reasoning under ``reasoning_field``; ``logprobs.content`` joined when chunks carried it."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.reasoning:
            message[reasoning_field] = "".join(self.reasoning)
        if "".join(self.refusal):
            message["refusal"] = "".join(self.refusal)
        if self.tool_calls:
            message["tool_calls"] = list(self.tool_calls.values())
        if any(k != "prompt_token_ids" for k in self.tokens):
            # prompt_token_ids alone is a server's own metadata (vLLM's return_token_ids), not a record.
            message.update(self.tokens)
        message.update(self.versions)
        return {
            "id": self.id or new_id("chatcmpl"),
            "object": "chat.completion",
            "created": int(self.created or time.time()),
            "model": self.model or "",
            "choices": [
                {
                    "index": self.index,
                    "finish_reason": self.finish_reason or "stop",
                    "logprobs": {"content": self.logprobs, "refusal": None} if self.logprobs is not None else None,
                    "message": message,
                }
            ],
            "usage": self.usage,
        }
