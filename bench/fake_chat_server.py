"""A fast fake OpenAI-compatible chat server for the gateway benchmark (run it in its own process).

Answers every ``POST .../chat/completions`` with the same tool-call completion (``get_weather``
for Paris, ``finish_reason: tool_calls``, usage) and ``GET .../models`` with one model, straight
from a raw asyncio protocol (HTTP/1.1 keep-alive, ``Content-Length`` bodies; no framework), so the
upstream costs almost nothing and what a benchmark measures is the server in front of it.

Usage: ``python bench/fake_chat_server.py --port 18200 [--host 127.0.0.1] [--delay-ms 0]``.
It prints ``ready <port>`` on stdout once it accepts connections, and serves until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

MODEL = "fake"


def completion_body() -> bytes:
    """The one ChatCompletion every chat request gets (a tool call, as a policy model would emit)."""
    return json.dumps(
        {
            "id": "chatcmpl-fake0000000000000000",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": MODEL,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "logprobs": None,
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "refusal": None,
                        "tool_calls": [
                            {
                                "id": "call_fake000000000000000000",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                            }
                        ],
                    },
                }
            ],
            "usage": {"prompt_tokens": 2048, "completion_tokens": 16, "total_tokens": 2064},
        },
        separators=(",", ":"),
    ).encode()


def models_body() -> bytes:
    return json.dumps(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "fake"}]}
    ).encode()


def _response(status: str, body: bytes) -> bytes:
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: keep-alive\r\n\r\n"
    ).encode() + body


class _Http(asyncio.Protocol):
    """Minimal HTTP/1.1: request line + headers, ``Content-Length`` body, keep-alive, pipelining."""

    def __init__(self, answers: dict[str, bytes], delay: float):
        self.answers = answers
        self.delay = delay
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buf) < end + 4 + length:
                return
            del self.buf[: end + 4 + length]
            method, path = head.split(" ", 2)[:2]
            path = path.split("?", 1)[0]
            if method == "POST" and path.endswith("/chat/completions"):
                out = self.answers["chat"]
            elif method == "GET" and path.endswith("/models"):
                out = self.answers["models"]
            elif method == "GET" and path.endswith("/health"):
                out = self.answers["health"]
            else:
                out = self.answers["404"]
            if self.delay:
                asyncio.get_running_loop().call_later(self.delay, self._write, out)
            else:
                self.transport.write(out)

    def _write(self, out: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(out)

    def connection_lost(self, exc):
        self.transport = None


async def serve(host: str, port: int, delay_ms: float = 0.0) -> None:
    answers = {
        "chat": _response("200 OK", completion_body()),
        "models": _response("200 OK", models_body()),
        "health": _response("200 OK", b"{}"),
        "404": _response("404 Not Found", b'{"error": {"message": "not found"}}'),
    }
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Http(answers, delay_ms / 1000), host, port, backlog=1024)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18200)
    p.add_argument("--delay-ms", type=float, default=0.0, help="answer this long after the request (default 0)")
    args = p.parse_args(argv)
    try:
        import uvloop  # optional: faster still

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(args.host, args.port, args.delay_ms))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
