"""Schema fuzzing: schemathesis generates requests for ``POST /v1/chat/completions``,
``POST /v1/responses``, ``POST /v1/completions``, ``POST /tokenize``, ``POST /detokenize`` and
``POST /v1/messages`` from the server's own OpenAPI document (the openai and anthropic SDKs' request
types; vLLM's for the tokenizer routes), valid ones and invalid ones, and sends them to a live
gymserve over the chat backend (a fast fake upstream) and over the local backend (the tiny model).
Every answer must be a 2xx, or a 4xx with an OpenAI error object (Anthropic's on ``/v1/messages``);
no 5xx, and nothing may take longer than ``HANG_S``.

Generation is the expensive part (tens to hundreds of ms per case for these large schemas on 2
cores), so each endpoint's cases are generated once, with a fixed derandomized seed, and replayed
against both backends. ``GYMSERVE_FUZZ_EXAMPLES`` sets the number of cases per endpoint (default
1000: 70 % schema-valid, 30 % schema-invalid); ``GYMSERVE_FUZZ_MESSAGES_EXAMPLES`` that of
``/v1/messages`` (default half as many: its cases cost twice as much to generate).
"""

from __future__ import annotations

import copy
import functools
import os
import time

import httpx
import orjson
import pytest

from helpers.fakes import ChatScript, FakeServer, completion, sse

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.core.errors import UnsupportedSchema  # noqa: E402

from gymserve.config import GymserveConfig, LocalBackendConfig, SamplingConfig, ServerConfig, validate_config  # noqa: E402
from gymserve.server.run import start_background_server  # noqa: E402

EXAMPLES = int(os.environ.get("GYMSERVE_FUZZ_EXAMPLES", "1000"))
# A Messages case costs about twice a Responses one to generate (measured here: ~0.6 s against
# ~0.3 s on 2 shared cores), so its route gets half as many unless told otherwise.
MESSAGES_EXAMPLES = int(os.environ.get("GYMSERVE_FUZZ_MESSAGES_EXAMPLES", str(EXAMPLES // 2)))
# The local backend replays every LOCAL_STRIDE-th case (each one that passes validation runs the
# tiny model): 500 per route by default keeps the suite's time in budget on 2 cores.
LOCAL_STRIDE = int(os.environ.get("GYMSERVE_FUZZ_LOCAL_STRIDE", "2"))
POSITIVE_SHARE = 0.7
HANG_S = 30.0
ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/completions", "/tokenize", "/detokenize", "/v1/messages")


def _upstream_answer(r):
    """A fast vLLM stand-in: a completion, or its chunks when asked to stream."""
    from gymserve.backends.chat_wire import completion_to_chunks

    done = completion("fuzzed", model=str(r.body.get("model")) if isinstance(r.body, dict) else "m")
    if isinstance(r.body, dict) and r.body.get("stream"):
        return sse(completion_to_chunks(done))
    return 200, done


def _legacy_answer(r):
    """vLLM's /v1/completions stand-in: one choice per prompt and n, whole or as chunks."""
    body = r.body if isinstance(r.body, dict) else {}
    head = {"id": "cmpl-fuzz", "object": "text_completion", "created": 1, "model": str(body.get("model"))}
    prompt = body.get("prompt")
    count = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    choices = [
        {"index": i, "text": "fuzzed", "logprobs": None, "finish_reason": "stop"}
        for i in range(count * (body.get("n") or 1))
    ]
    if body.get("stream"):
        return sse([{**head, "choices": [c]} for c in choices])
    return 200, {**head, "choices": choices, "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def _upstream(r):
    """The chat stand-in, plus /v1/completions, /tokenize and /detokenize as vLLM answers them."""
    if r.path == "/v1/completions":
        return _legacy_answer(r)
    if r.path == "/tokenize":
        return 200, {"count": 3, "max_model_len": 4096, "tokens": [1, 2, 3], "token_strs": None}
    if r.path == "/detokenize":
        return 200, {"prompt": "fuzzed"}
    return _CHAT(r)


_CHAT = ChatScript(name="fuzz", default=_upstream_answer)


@pytest.fixture(scope="module")
def upstream():
    with FakeServer(_upstream) as s:
        yield s


@pytest.fixture(scope="module")
def chat_server(upstream):
    cfg = validate_config(
        {
            "server": {"port": 0},
            "backend": {
                "type": "chat",
                "base_urls": [upstream.url + "/v1"],
                "model": "policy",
                "max_retries": 0,
                "timeout": 10,
            },
        }
    )
    srv = start_background_server(cfg)
    yield srv
    srv.stop()


class _Clamped:
    """The tiny model's engine with every call clamped to 2 generated tokens (fuzz cost, not behaviour)."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _clamp(self, sampling):
        import dataclasses

        return dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, 2))

    async def generate(self, prompt_ids, sampling):
        return await self._engine.generate(prompt_ids, self._clamp(sampling))

    def stream(self, prompt_ids, sampling):
        return self._engine.stream(prompt_ids, self._clamp(sampling))


@pytest.fixture(scope="module")
def local_server(tiny_model_dir):
    from gymserve.backends.local import LocalBackend

    cfg = GymserveConfig(
        server=ServerConfig(port=0),
        backend=LocalBackendConfig(
            model=str(tiny_model_dir), context_window=512, sampling=SamplingConfig(seed=1, pin="override")
        ),
    )

    def factory():
        backend = LocalBackend.from_config(cfg.backend)
        backend.engine = _Clamped(backend.engine)
        return backend

    srv = start_background_server(cfg, backend_factory=factory)
    yield srv
    srv.stop()


def _examples(route: str) -> int:
    return MESSAGES_EXAMPLES if route == "/v1/messages" else EXAMPLES


@functools.cache
def _cases(root: str, route: str) -> tuple:
    """``_examples(route)`` schemathesis cases for ``route`` (positive, then negative), generated once.

    The SDK's ``ResponseCreateParams`` leaves ``input`` optional (OpenAI can continue a stored
    conversation); gymserve stores nothing and requires it, so without help more than half the
    "valid" Responses cases stop at "input is required". Positive cases are therefore generated
    from the served schema with ``input`` marked required (and Messages' ``messages`` non-empty);
    negative ones from the schema as served.
    """
    from schemathesis import GenerationMode

    doc = httpx.get(root + "/openapi.json", timeout=30).json()
    positive_doc = copy.deepcopy(doc)
    body = positive_doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    body["required"] = sorted({*body.get("required", []), "input"})
    # Likewise the SDK's `messages` may be empty; Anthropic (and gymserve) need one message at least.
    for name in ("MessagesMessageCreateParamsNonStreaming", "MessagesMessageCreateParamsStreaming"):
        positive_doc["components"]["schemas"][name]["properties"]["messages"]["minItems"] = 1
    out: list = []
    unsupported: list = []
    n_all = _examples(route)
    n_pos = round(n_all * POSITIVE_SHARE)
    for mode, n, d in (
        (GenerationMode.POSITIVE, n_pos, positive_doc),
        (GenerationMode.NEGATIVE, n_all - n_pos, doc),
    ):
        strategy = schemathesis.openapi.from_dict(d)[route]["POST"].as_strategy(generation_mode=mode)

        @settings(
            max_examples=n,
            derandomize=True,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(data=st.data())
        def collect(data):
            try:
                out.append(data.draw(strategy))  # noqa: B023 - collect() runs within this iteration
            except UnsupportedSchema:
                # Negative mode sometimes picks a sub-schema it cannot negate (a `not` deep in the SDK
                # schema); that draw is skipped rather than ending the whole run.
                unsupported.append(mode)  # noqa: B023 - as above

        collect()
    if unsupported:
        print(f"\n{route}: {len(unsupported)} draws skipped (schemathesis cannot negate that sub-schema)")
    return tuple(out)


def _problem(status: int, stream: bool, text: str, *, anthropic: bool = False) -> str | None:
    """Why this answer breaks the contract (None when it is fine); ``anthropic``: a Messages API
    route, whose errors are ``{"type": "error", "error": {"type", "message"}}``."""
    if status >= 500:
        return f"{status} server error"
    if status >= 400 and anthropic:
        try:
            body = orjson.loads(text)
            err = body["error"]
        except Exception:  # noqa: BLE001
            return f"{status} without an Anthropic error object"
        if body.get("type") != "error" or not (
            isinstance(err, dict)
            and isinstance(err.get("message"), str)
            and err["message"]
            and isinstance(err.get("type"), str)
        ):
            return f"{status} Anthropic error object incomplete: {body}"
        return None
    if status >= 400:
        try:
            err = orjson.loads(text)["error"]
        except Exception:  # noqa: BLE001
            return f"{status} without an OpenAI error object"
        if not (
            isinstance(err.get("message"), str)
            and err["message"]
            and isinstance(err.get("type"), str)
            and "param" in err
            and "code" in err
        ):
            return f"{status} error object incomplete: {err}"
        return None
    if status == 200 and stream:
        if not text.startswith(("data: ", "event: ")) or "data: {" not in text:
            return "200 stream without events"
    elif status == 200:
        try:
            body = orjson.loads(text)
        except Exception:  # noqa: BLE001
            return "200 with a body that is not JSON"
        if not isinstance(body, dict):
            return "200 with a non-object body"
    return None


def _fuzz(server, route: str, cases) -> dict[int, int]:
    import requests

    root = server.base_url.removesuffix("/v1")
    statuses: dict[int, int] = {}
    problems = []
    slowest = 0.0
    reasons: dict[str, int] = {}
    with requests.Session() as session:
        for case in cases:
            t0 = time.monotonic()
            try:
                r = case.call(base_url=root, session=session, timeout=HANG_S)
            except requests.Timeout:
                problems.append(("hang", case.body))
                continue
            slowest = max(slowest, time.monotonic() - t0)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            why = _problem(
                r.status_code,
                bool((case.body or {}).get("stream")) if isinstance(case.body, dict) else False,
                r.text,
                anthropic=route == "/v1/messages",
            )
            if 400 <= r.status_code < 500 and not why:
                msg = orjson.loads(r.text)["error"]["message"][:70]
                reasons[msg] = reasons.get(msg, 0) + 1
            if why:
                problems.append((why, case.body, r.text[:400]))
    print(
        f"\n{route} on {server.backend.name}: {len(cases)} cases, statuses {dict(sorted(statuses.items()))}, "
        f"slowest {slowest:.2f} s; most common 4xx: {sorted(reasons.items(), key=lambda kv: -kv[1])[:4]}"
    )
    assert not problems, f"{len(problems)} contract violations, first: " + "\n".join(
        repr(p)[:1500] for p in problems[:5]
    )
    return statuses


@pytest.mark.parametrize("route", ROUTES)
def test_fuzz_chat_backend(chat_server, route):
    cases = _cases(chat_server.base_url.removesuffix("/v1"), route)
    assert len(cases) >= _examples(route) * 0.9
    statuses = _fuzz(chat_server, route, cases)
    assert sum(v for k, v in statuses.items() if 400 <= k < 500) > 0
    if route in ("/v1/chat/completions", "/tokenize", "/detokenize") or EXAMPLES >= 500:
        assert statuses.get(200, 0) > 0


@pytest.mark.parametrize("route", ROUTES)
def test_fuzz_local_backend(chat_server, local_server, route):
    cases = _cases(chat_server.base_url.removesuffix("/v1"), route)[::LOCAL_STRIDE]  # generated once
    statuses = _fuzz(local_server, route, cases)
    assert sum(v for k, v in statuses.items() if 400 <= k < 500) > 0


# ------------------------------------------------------------------------------- hand-written bad input
BAD_REQUESTS = [
    ("POST", "/v1/chat/completions", b"", 400),
    ("POST", "/v1/chat/completions", b"{oops", 400),
    ("POST", "/v1/chat/completions", b"[1, 2]", 400),
    ("POST", "/v1/chat/completions", b"\xff\xfe\x00garbage", 400),
    ("POST", "/v1/chat/completions", b"[" * 5000 + b"]" * 5000, 400),  # nesting beyond the parser's limit
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400),
    (
        "POST",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "stream": true, "stream_options": true}',
        400,
    ),  # found by fuzzing: was a 500 (local)
    ("POST", "/v1/responses", b'{"input": 5}', 400),
    ("POST", "/v1/responses", b'{"input": [{"type": "nope"}]}', 400),
    ("POST", "/v1/responses", b'{"input": "x", "stream": 1}', 400),
    ("POST", "/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400),
    ("POST", "/v1/completions", b'{"prompt": [[1], [2, "x"]]}', 400),
    ("POST", "/tokenize", b'{"prompt": 5}', 400),
    ("POST", "/tokenize", b"[1]", 400),
    ("POST", "/detokenize", b'{"tokens": "1"}', 400),
    ("GET", "/tokenize", None, 405),
    ("POST", "/v1/messages", b"{oops", 400),
    ("POST", "/v1/messages", b'{"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": 7}]}]}', 400),
    ("POST", "/v1/messages", b'{"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stream": 1}', 400),
    ("POST", "/v1/messages/count_tokens", b'{"messages": "x"}', 400),
    ("GET", "/v1/messages", None, 405),
    ("GET", "/v1/chat/completions", None, 405),
    ("GET", "/v1/responses", None, 405),
    ("POST", "/v1/models", b"{}", 405),
    ("POST", "/health", b"{}", 405),
    ("GET", "/v1/nothing-here", None, 404),
    ("GET", "/chat/completions", None, 404),
]


@pytest.mark.parametrize("method, path, body, status", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(chat_server, local_server, method, path, body, status):
    for srv in (chat_server, local_server):
        root = srv.base_url.removesuffix("/v1")
        r = httpx.request(method, root + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        local_only = b"stream_options" in (body or b"") and srv is chat_server  # the chat upstream decides that one
        if not local_only:
            assert r.status_code == status, (srv.backend.name, r.text)
        anthropic = path.startswith("/v1/messages")
        assert _problem(r.status_code, b'"stream": true' in (body or b""), r.text, anthropic=anthropic) is None, r.text
