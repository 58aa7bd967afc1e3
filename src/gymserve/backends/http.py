"""A lean JSON-over-HTTP client (aiohttp) for the chat backend's non-streamed calls.

Why not the openai SDK here: on the RL hot path (a self-hosted vLLM/SGLang replica answering in a
few milliseconds) the SDK's request building plus httpx's transport were ~60% of gymserve's CPU per
request (py-spy, bench/gateway.py), enough to miss the 1 ms / 1 CPU-second-per-1,000-requests
budget. aiohttp with orjson does the same POST for a fraction of that. The SDK stays in use where it
fits: streaming, OpenAI and Azure (whose auth and URL rules it encodes), and model listing.

Failures are raised in shapes ``upstream_errors.translate_error`` already reads: ``HTTPStatusFailure``
carries ``status_code``/``response``/``body`` like the SDK's ``APIStatusError``; connection errors
are aiohttp's own (their names are listed in ``upstream_errors``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson


@dataclass
class _SentRequest:
    url: str
    method: str = "POST"


@dataclass
class _Answer:
    """The parts of a response ``translate_error`` reads (``json()``, ``text``, ``headers``, ``request``)."""

    status_code: int
    text: str
    headers: dict[str, str]
    request: _SentRequest

    def json(self) -> Any:
        return orjson.loads(self.text)


class HTTPStatusFailure(Exception):
    """The upstream answered with status >= 400; ``body`` is its parsed JSON (or the raw text)."""

    def __init__(self, status_code: int, response: _Answer, body: Any):
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code
        self.response = response
        self.body = body


class JSONClient:
    """POSTs JSON to one upstream and returns the parsed JSON answer.

    ``headers``/``params`` are sent on every request (auth, ``default_headers``, ``default_query``);
    ``limit`` bounds open connections; ``timeout`` bounds connecting and each read (seconds). The
    aiohttp session is created on first use, inside the serving event loop.
    """

    def __init__(self, *, headers: dict[str, str], params: dict[str, Any] | None, limit: int, timeout: float):
        self._headers = {"Content-Type": "application/json", "Accept": "application/json", **headers}
        self._params = {k: str(v) for k, v in (params or {}).items()} or None
        self._limit = limit
        self._timeout = timeout
        self._session = None

    def _get_session(self):
        if self._session is None or self._session.closed:
            import aiohttp

            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._limit, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=None, connect=self._timeout, sock_read=self._timeout),
                headers=self._headers,
                skip_auto_headers=("User-Agent",),
                raise_for_status=False,
            )
        return self._session

    async def post(self, url: str, body: dict[str, Any], *, headers: dict[str, str] | None = None) -> Any:
        """The parsed JSON answer (``headers`` added to the client's own); raises ``HTTPStatusFailure``
        for status >= 400, aiohttp's errors for connection failures and ``orjson.JSONDecodeError``
        for an answer that is not JSON."""
        async with self._get_session().post(url, data=orjson.dumps(body), params=self._params, headers=headers) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                text = raw.decode("utf-8", "replace")
                try:
                    parsed: Any = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    parsed = text
                # Names lower-cased: readers look headers up as httpx's case-insensitive ones (``retry-after``).
                headers = {k.lower(): v for k, v in resp.headers.items()}
                answer = _Answer(resp.status, text, headers, _SentRequest(str(resp.url)))
                raise HTTPStatusFailure(resp.status, answer, parsed)
            return orjson.loads(raw)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
