"""In-process fake upstreams: OpenAI, Azure OpenAI (and gateways in front of it), Anthropic's
Messages API, and scriptable OpenAI-compatible chat servers.

Each runs a Starlette app under uvicorn on 127.0.0.1 and a free port, in a daemon thread, records
every request (method, path, query, headers, JSON body) and checks it the way the cloud would:
OpenAI wants ``Authorization: Bearer <key>``; Azure wants the ``api-key`` header and the
``api-version`` query parameter and answers a bare 404 ``Resource not found`` for a missing
api-version or a path it does not serve (e.g. a deployment-scoped Responses URL); Anthropic wants
``x-api-key`` and ``anthropic-version`` and refuses unknown fields.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gymserve.backends.chat_wire import completion_to_chunks
from gymserve.engine.base import SamplingParams, TokenDelta, collect


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any


Answer = tuple[int, Any] | tuple[int, Any, dict[str, str]] | Response


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServer:
    """Serve ``handler(recorded) -> (status, json[, headers]) | Response`` on 127.0.0.1.

    ``url`` is ``http://127.0.0.1:<port>``; ``requests`` the recorded requests; ``stop()`` and
    ``start()`` again (same port) simulate a replica going down and coming back.
    """

    def __init__(self, handler: Callable[[Recorded], Answer], port: int | None = None):
        self.handler = handler
        self.port = port or free_port()
        self.requests: list[Recorded] = []
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        methods = ["GET", "POST", "PUT", "DELETE", "PATCH"]
        self.app = Starlette(routes=[Route("/{path:path}", self._endpoint, methods=methods)])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _endpoint(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        rec = Recorded(
            request.method,
            request.url.path,
            dict(request.query_params),
            {k.lower(): v for k, v in request.headers.items()},
            body,
        )
        self.requests.append(rec)
        answer = self.handler(rec)
        if callable(getattr(answer, "__await__", None)):
            answer = await answer
        if isinstance(answer, Response):
            return answer
        status, payload, *rest = answer
        return JSONResponse(payload, status_code=status, headers=rest[0] if rest else None)

    def start(self) -> FakeServer:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"fake server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)
            self._server = None

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def chat_requests(self) -> list[Recorded]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]


# ---------------------------------------------------------------------------------- payloads
def completion(
    content: str | None = "ok",
    *,
    model: str = "m",
    finish_reason: str = "stop",
    extra: dict[str, Any] | None = None,
    **message_fields: Any,
) -> dict[str, Any]:
    """A ChatCompletion dict; ``message_fields`` go on the message, ``extra`` on the completion."""
    return {
        "id": "chatcmpl-" + uuid.uuid4().hex[:8],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "finish_reason": finish_reason,
                "logprobs": None,
                "message": {"role": "assistant", "content": content, **message_fields},
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        **(extra or {}),
    }


def response_obj(text: str, *, model: str) -> dict[str, Any]:
    """A minimal Responses API ``Response`` dict."""
    return {
        "id": "resp_" + uuid.uuid4().hex[:8],
        "object": "response",
        "created_at": time.time(),
        "status": "completed",
        "model": model,
        "error": None,
        "incomplete_details": None,
        "output": [
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4},
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }


def sse(chunks: list[dict[str, Any]]) -> StreamingResponse:
    """Chat Completions streaming: ``data:`` lines, then ``data: [DONE]``."""

    def gen():
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream")


def sse_events(events: list[dict[str, Any]]) -> StreamingResponse:
    """Responses streaming as the OpenAI API sends it: ``event: <type>`` + ``data:``, no ``[DONE]``."""

    def gen():
        for e in events:
            yield f"event: {e['type']}\ndata: {json.dumps(e)}\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream")


def _pieces(text: str, n: int = 3) -> list[str]:
    """``text`` cut into about ``n`` non-empty pieces (at least one)."""
    size = max(1, -(-len(text) // n))
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def chat_chunks(comp: dict[str, Any], *, include_usage: bool = False) -> list[dict[str, Any]]:
    """A ChatCompletion dict streamed as a chat server does: a role chunk, the content in pieces,
    a finish chunk, then (``stream_options.include_usage``) a ``choices: []`` usage chunk."""
    head = {"id": comp["id"], "object": "chat.completion.chunk", "created": comp["created"], "model": comp["model"]}
    choice = comp["choices"][0]

    def chunk(delta, finish=None):
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": p}) for p in _pieces(choice["message"].get("content") or "") if p]
    out.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        out.append({**head, "choices": [], "usage": comp["usage"]})
    return out


def chat_answer(r: Recorded, comp: dict[str, Any]) -> Answer:
    """``comp`` as JSON, or streamed when the request asks for ``stream: true``."""
    if r.body.get("stream"):
        include = bool((r.body.get("stream_options") or {}).get("include_usage"))
        return sse(chat_chunks(comp, include_usage=include))
    return 200, comp


def response_events(done: dict[str, Any]) -> list[dict[str, Any]]:
    """The OpenAI API's event stream for a one-message ``Response``: created, in_progress, the
    message item's lifecycle with the text in deltas, completed; ``sequence_number`` 0, 1, 2…"""
    events: list[dict[str, Any]] = []

    def ev(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    shell = {**done, "status": "in_progress", "output": [], "usage": None}
    ev("response.created", response=shell)
    ev("response.in_progress", response=shell)
    for oi, item in enumerate(done["output"]):
        ev("response.output_item.added", output_index=oi, item={**item, "status": "in_progress", "content": []})
        for ci, part in enumerate(item["content"]):
            where = {"item_id": item["id"], "output_index": oi, "content_index": ci}
            ev("response.content_part.added", **where, part={**part, "text": ""})
            for piece in _pieces(part["text"]):
                ev("response.output_text.delta", **where, delta=piece, logprobs=[])
            ev("response.output_text.done", **where, text=part["text"], logprobs=[])
            ev("response.content_part.done", **where, part=part)
        ev("response.output_item.done", output_index=oi, item=item)
    ev("response.completed", response=done)
    return events


def responses_answer(r: Recorded, done: dict[str, Any]) -> Answer:
    """``done`` as JSON, or as its event stream when the request asks for ``stream: true``."""
    return sse_events(response_events(done)) if r.body.get("stream") else (200, done)


# ---------------------------------------------------------------------------------- OpenAI
CLOUD_KEY = "cloud-KEY-0123456789abcdef"
"""The API key the fake OpenAI / Azure servers of the ``openai_fake`` / ``azure_fake`` fixtures accept."""
AZURE_VERSION = "2025-04-01-preview"
"""The ``api-version`` the ``azure_fake`` fixture's server accepts."""


def openai_handler(api_key: str, model: str = "gpt-test") -> Callable[[Recorded], Answer]:
    """Like api.openai.com: Bearer auth, /v1/chat/completions, /v1/responses, /v1/models."""

    def handle(r: Recorded) -> Answer:
        if r.headers.get("authorization") != f"Bearer {api_key}":
            return 401, {
                "error": {
                    "message": "Incorrect API key provided.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        if r.method == "GET" and r.path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "openai"}]}
        if r.method == "POST" and r.path == "/v1/chat/completions":
            if r.body.get("model") != model or not isinstance(r.body.get("messages"), list):
                return 400, {"error": {"message": "bad model or messages", "type": "invalid_request_error"}}
            return chat_answer(r, completion("hello from openai", model=model))
        if r.method == "POST" and r.path == "/v1/responses":
            if r.body.get("model") != model or "input" not in r.body:
                return 400, {"error": {"message": "bad model or input", "type": "invalid_request_error"}}
            if r.body["input"] == "overflow":
                return 400, {
                    "error": {
                        "message": "Your input exceeds the context window of this model.",
                        "type": "invalid_request_error",
                        "param": "input",
                        "code": "context_length_exceeded",
                    }
                }
            return responses_answer(r, response_obj("hello from responses", model=model))
        return 404, {
            "error": {
                "message": f"Invalid URL ({r.method} {r.path})",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }

    return handle


# ---------------------------------------------------------------------------------- Azure
AZ_NOT_FOUND = (404, {"error": {"code": "404", "message": "Resource not found"}})


def azure_handler(
    *,
    api_key: str,
    api_version: str,
    deployment: str,
    chat_paths: tuple[str, ...] | None = None,
    responses_paths: tuple[str, ...] | None = None,
) -> Callable[[Recorded], Answer]:
    """Like an Azure OpenAI resource (or a gateway with ``chat_paths``/``responses_paths``).

    Default paths: ``/openai/deployments/{deployment}/chat/completions``; ``/openai/responses`` and
    ``/openai/v1/responses`` (body.model must be the deployment); ``/openai/models``.
    """
    chat_paths = chat_paths or (f"/openai/deployments/{deployment}/chat/completions",)
    responses_paths = responses_paths or ("/openai/responses", "/openai/v1/responses")

    def handle(r: Recorded) -> Answer:
        if r.query.get("api-version") != api_version:
            return AZ_NOT_FOUND
        if r.headers.get("api-key") != api_key or api_key in r.headers.get("authorization", ""):
            return 401, {
                "error": {
                    "code": "401",
                    "message": "Access denied due to invalid subscription key or wrong "
                    "API endpoint. Make sure to provide a valid key.",
                }
            }
        if r.method == "GET" and r.path.endswith("/models"):
            return 200, {"object": "list", "data": [{"id": "gpt-4o", "object": "model"}]}
        if r.method == "POST" and r.path in chat_paths:
            return chat_answer(r, completion("hello from azure chat", model="gpt-4o-2024-08-06"))
        if r.method == "POST" and r.path in responses_paths:
            if r.body.get("model") != deployment:
                return 404, {
                    "error": {
                        "code": "DeploymentNotFound",
                        "message": "The API deployment for this resource does not exist.",
                    }
                }
            return responses_answer(r, response_obj("hello from azure responses", model="gpt-4o-2024-08-06"))
        return AZ_NOT_FOUND

    return handle


# ---------------------------------------------------------------------------------- Anthropic
ANTHROPIC_VERSION = "2023-06-01"
_ANTHROPIC_FIELDS = {
    "model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "tools",
    "tool_choice", "metadata", "stream", "thinking", "output_config", "service_tier", "cache_control",
}  # fmt: skip


def anthropic_error(status: int, kind: str, message: str) -> tuple[int, dict[str, Any]]:
    """Anthropic's error body (``{"type": "error", "error": {"type", "message"}, "request_id"}``)."""
    return status, {"type": "error", "error": {"type": kind, "message": message}, "request_id": "req_fake"}


def _extra_input(obj: Any, path: str, allowed: set[str] | None = None) -> str | None:
    """Where ``obj`` holds a key the Messages API does not take (gymserve's training fields)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if (allowed is not None and key not in allowed) or key in ("prompt_token_ids", "generation_token_ids"):
                return f"{path}.{key}".lstrip(".")
            found = _extra_input(value, f"{path}.{key}")
            if found:
                return found
    if isinstance(obj, list):
        for i, value in enumerate(obj):
            found = _extra_input(value, f"{path}.{i}")
            if found:
                return found
    return None


def anthropic_message(body: dict[str, Any], model: str) -> dict[str, Any]:
    """What the fake answers: a thinking block and a ``tool_use`` of the first tool when tools are
    given (``stop_reason: tool_use``), else a text (``stop_sequence`` when asked for ``END``)."""
    stops = body.get("stop_sequences") or []
    if body.get("tools") and (body.get("tool_choice") or {}).get("type") != "none":
        content = [
            {"type": "thinking", "thinking": "The user wants the weather.", "signature": "sig-1"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_01", "name": body["tools"][0]["name"], "input": {"city": "Paris"}},
        ]
        stop, sequence = "tool_use", None
    elif "END" in stops:
        content, stop, sequence = [{"type": "text", "text": "hello"}], "stop_sequence", "END"
    else:
        content, stop, sequence = [{"type": "text", "text": "hello from anthropic"}], "end_turn", None
    return {
        "id": "msg_01fake" + uuid.uuid4().hex[:8],
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": sequence,
        "usage": {
            "input_tokens": 10,
            "output_tokens": 5,
            "cache_read_input_tokens": 3,
            "cache_creation_input_tokens": 0,
        },
    }


def anthropic_events(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The event stream Anthropic sends for ``message`` ("Streaming Messages"): start, ping, each
    block's start / deltas in two pieces / stop (thinking with its signature_delta), message_delta,
    message_stop."""
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {**message["usage"], "output_tokens": 1}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}, {"type": "ping"}]
    for i, block in enumerate(message["content"]):
        kind = block["type"]
        empty = {"tool_use": {**block, "input": {}}, "text": {"type": "text", "text": ""}}
        empty["thinking"] = {"type": "thinking", "thinking": "", "signature": ""}
        events.append({"type": "content_block_start", "index": i, "content_block": empty[kind]})
        if kind == "tool_use":
            whole, key, delta_type = json.dumps(block["input"]), "partial_json", "input_json_delta"
        else:
            whole, key, delta_type = block[kind], kind, f"{kind}_delta"
        for piece in _pieces(whole, 2):
            events.append({"type": "content_block_delta", "index": i, "delta": {"type": delta_type, key: piece}})
        if kind == "thinking":
            signature = {"type": "signature_delta", "signature": block["signature"]}
            events.append({"type": "content_block_delta", "index": i, "delta": signature})
        events.append({"type": "content_block_stop", "index": i})
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    events.append(
        {"type": "message_delta", "delta": delta, "usage": {"output_tokens": message["usage"]["output_tokens"]}}
    )
    events.append({"type": "message_stop"})
    return events


def anthropic_handler(api_key: str, model: str = "claude-test") -> Callable[[Recorded], Answer]:
    """Like api.anthropic.com: ``x-api-key`` (never ``Authorization``) and ``anthropic-version``
    headers, ``POST /v1/messages`` (strict fields: "Extra inputs are not permitted"; ``max_tokens``
    required; an unknown model is a 404; the user text ``overflow`` is "prompt is too long"),
    ``POST /v1/messages/count_tokens`` and ``GET /v1/models``."""

    def handle(r: Recorded) -> Answer:
        if r.headers.get("anthropic-version") != ANTHROPIC_VERSION:
            return anthropic_error(400, "invalid_request_error", "anthropic-version: header is required")
        if r.headers.get("x-api-key") != api_key or "authorization" in r.headers:
            return anthropic_error(401, "authentication_error", "invalid x-api-key")
        if r.method == "GET" and r.path == "/v1/models":
            row = {"type": "model", "id": model, "display_name": "Claude Test", "created_at": "2025-01-01T00:00:00Z"}
            return 200, {"data": [row], "has_more": False, "first_id": model, "last_id": model}
        if r.method != "POST" or r.path not in ("/v1/messages", "/v1/messages/count_tokens"):
            return anthropic_error(404, "not_found_error", f"Not found: {r.method} {r.path}")
        body = r.body if isinstance(r.body, dict) else {}
        allowed = _ANTHROPIC_FIELDS - ({"max_tokens", "stream", "stop_sequences"} if "count" in r.path else set())
        extra = _extra_input(body, "", allowed)
        if extra:
            return anthropic_error(400, "invalid_request_error", f"{extra}: Extra inputs are not permitted")
        if body.get("model") != model:
            return anthropic_error(404, "not_found_error", f"model: {body.get('model')}")
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return anthropic_error(400, "invalid_request_error", "messages: Field required")
        if "count" in r.path:
            return 200, {"input_tokens": 42}
        if not isinstance(body.get("max_tokens"), int):
            return anthropic_error(400, "invalid_request_error", "max_tokens: Field required")
        last = body["messages"][-1].get("content")
        if last == "overflow" or (isinstance(last, list) and last[-1:] == [{"type": "text", "text": "overflow"}]):
            return anthropic_error(400, "invalid_request_error", "prompt is too long: 250000 tokens > 200000 maximum")
        message = anthropic_message(body, model)
        return sse_events(anthropic_events(message)) if body.get("stream") else (200, message)

    return handle


# ---------------------------------------------------------------------------------- chat servers
@dataclass
class ChatScript:
    """A scriptable OpenAI-compatible chat server (vLLM stand-in).

    ``plan``: answers consumed one per chat request before falling back to ``default``;
    ``default(recorded)`` builds the normal answer (by default a completion naming ``name``).
    """

    name: str = "replica"
    plan: list[Answer] = field(default_factory=list)
    default: Callable[[Recorded], Answer] | None = None
    tokenize: Callable[[Recorded], Answer] | None = None

    def __call__(self, r: Recorded) -> Answer:
        if r.method == "GET" and r.path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "policy", "object": "model"}]}
        if r.path == "/tokenize" and self.tokenize is not None:
            return self.tokenize(r)
        if r.path != "/v1/chat/completions":
            return 404, {"detail": "Not Found"}
        if self.plan:
            return self.plan.pop(0)
        if self.default is not None:
            return self.default(r)
        return 200, completion(f"from {self.name}", model=r.body.get("model", "m"))


def vllm_error(message: str, status: int = 400) -> tuple[int, dict[str, Any]]:
    """vLLM's error body (``{"object": "error", "message", "type", "code"}``)."""
    return status, {"object": "error", "type": "BadRequestError", "code": status, "message": message}


class RawServer:
    """A TCP server on 127.0.0.1 that misbehaves at the HTTP level, one ``mode`` for all connections.

    Modes: ``reset`` (RST right after the request), ``close`` (close without answering), ``hang``
    (never answer), ``malformed`` (200 + invalid JSON), ``truncated`` (Content-Length larger than
    what is sent, then close), ``stall_body`` (headers and half a body, then nothing), ``trickle``
    (a valid body, one byte every 0.1 s), ``stream_stall`` (SSE headers and one chunk, then nothing),
    ``stream_drop`` (SSE headers and two events — chat chunks, or ``response.created`` and
    ``.in_progress`` for a ``/responses`` URL — then the connection is shut, no ``[DONE]``).
    Every wait is bounded by ``stop()``.
    """

    def __init__(self, mode: str):
        self.mode = mode
        self.requests = 0
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.1)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._loop, daemon=True)
        self._accept.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _read_request(self, conn: socket.socket) -> bool:
        conn.settimeout(5)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        while len(rest) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            rest += chunk
        self.requests += 1
        self.last_path = data.split(b" ", 2)[1].split(b"?")[0].decode()
        return True

    def _wait(self, seconds: float = 30) -> None:
        self._stop.wait(seconds)

    def _handle(self, conn: socket.socket) -> None:
        try:
            if not self._read_request(conn):
                return
            body = json.dumps(completion("fine")).encode()
            head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            if self.mode == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            elif self.mode == "close":
                pass
            elif self.mode == "hang":
                self._wait()
            elif self.mode == "malformed":
                bad = b'{"choices": [ {"message": oops'
                conn.sendall(head + b"content-length: %d\r\n\r\n" % len(bad) + bad)
                self._wait(1)
            elif self.mode == "truncated":
                conn.sendall(head + b"content-length: %d\r\n\r\n" % len(body) + body[: len(body) // 2])
            elif self.mode == "stall_body":
                conn.sendall(head + b"content-length: %d\r\n\r\n" % len(body) + body[: len(body) // 2])
                self._wait()
            elif self.mode == "trickle":
                conn.sendall(head + b"content-length: %d\r\n\r\n" % len(body))
                for i in range(len(body)):
                    if self._stop.wait(0.1):
                        return
                    conn.sendall(body[i : i + 1])
            elif self.mode == "stream_stall":
                chunk = json.dumps(completion_to_chunks(completion("partial"))[0]).encode()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                event = b"data: " + chunk + b"\n\n"
                conn.sendall(b"%x\r\n" % len(event) + event + b"\r\n")
                self._wait()
            elif self.mode == "stream_drop":
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                if self.last_path.endswith("/responses"):
                    events = response_events(response_obj("partial answer", model="policy"))[:2]
                    payloads = [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events]
                else:
                    head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "policy"}
                    chunks = [
                        {
                            **head,
                            "choices": [
                                {"index": 0, "finish_reason": None, "delta": {"role": "assistant", "content": piece}}
                            ],
                        }
                        for piece in ("partial ", "answer")
                    ]
                    payloads = [f"data: {json.dumps(c)}\n\n" for c in chunks]
                for payload in payloads:
                    raw = payload.encode()
                    conn.sendall(b"%x\r\n" % len(raw) + raw + b"\r\n")
                time.sleep(0.05)
                conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        self._accept.join(5)
        self._sock.close()
        for t in self._threads:
            t.join(5)


class ScriptedEngine:
    """An ``Engine`` that "generates" the token IDs of a fixed text, one token per step, then the
    end-of-turn token, the first of ``eos_tokens`` (``repeat``: the text over and over until
    ``max_tokens``); a text holding an end-of-turn token stops there. ``text_ids`` may be replaced
    between calls to script the next turn. Records each
    stream's end: ``finished`` (ran to its finish reason) or ``cancelled`` (closed early)."""

    def __init__(
        self,
        tokenizer,
        text: str,
        *,
        delay: float = 0.0,
        repeat: bool = False,
        eos_tokens: tuple[str, ...] = ("<|im_end|>",),
        model_type: str = "qwen2",
    ):
        self.model_name = "scripted"
        self.model_type = model_type  # the tokenizer's model
        self.eos_token_ids = tuple(tokenizer.convert_tokens_to_ids(t) for t in eos_tokens)
        self.context_window = 32768
        self.vocab_size = len(tokenizer)
        self.text_ids = tokenizer.encode(text, add_special_tokens=False)
        self.delay, self.repeat = delay, repeat
        self.started = threading.Event()
        self.cancelled = threading.Event()
        self.finished = 0
        self.steps = 0

    async def generate(self, prompt_ids, sampling: SamplingParams):
        return await collect(self.stream(prompt_ids, sampling))

    async def stream(self, prompt_ids, sampling: SamplingParams):
        self.started.set()
        done = False
        try:
            i = 0
            while True:
                if i < len(self.text_ids) or self.repeat:
                    tid = self.text_ids[i % len(self.text_ids)]
                else:
                    tid = self.eos_token_ids[0]
                i += 1
                if self.delay:
                    await asyncio.sleep(self.delay)
                self.steps += 1
                finish = "stop" if tid in self.eos_token_ids else ("length" if i >= sampling.max_tokens else None)
                yield TokenDelta([tid], [-0.01 * i], finish)
                if finish:
                    done = True
                    return
        finally:
            if done:
                self.finished += 1
            else:
                self.cancelled.set()

    async def close(self) -> None:
        return None
