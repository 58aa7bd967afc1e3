"""Who gets in and what leaks: the server's own API key, the bind address, upstream keys in logs,
errors, /metrics and capture, the body-size limit, and base URLs that only configuration sets."""

from __future__ import annotations

import logging

import httpx
import pytest

from gymserve.config import ServerConfig, validate_config
from gymserve.server.run import start_background_server
from helpers.fakes import ChatScript, FakeServer, completion

SERVER_KEY = "gs-server-key-0123456789"
UPSTREAM_KEY = "sk-upstream-TOPSECRET-9f8e7d6c5b4a"
MSG = [{"role": "user", "content": "hi"}]


def _chat_config(url: str, **server) -> dict:
    return {
        "server": {"port": 0, **server},
        "backend": {
            "type": "chat",
            "base_urls": [url + "/v1"],
            "model": "policy",
            "api_key": UPSTREAM_KEY,
            "max_retries": 1,
            "retry_backoff": 0.01,
            "timeout": 5,
        },
    }


@pytest.fixture
def upstream():
    with FakeServer(ChatScript(name="up")) as s:
        yield s


# ------------------------------------------------------------------------------- the server's key
@pytest.fixture
def locked(upstream):
    with start_background_server(validate_config(_chat_config(upstream.url, api_key=SERVER_KEY))) as srv:
        yield srv


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/responses"),
        ("POST", "/v1/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/nope"),
        ("DELETE", "/v1/responses"),
    ],
)
def test_every_route_but_health_needs_the_key(locked, method, path):
    root = locked.base_url.removesuffix("/v1")
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {SERVER_KEY}"},
        {"Authorization": f"Bearer {SERVER_KEY}x"},
        {"Authorization": f"Bearer {SERVER_KEY[:-1]}"},
        {"api-key": "nope"},
        {"Authorization": "Bearer"},
    ):
        r = httpx.request(method, root + path, headers=headers, json={"messages": MSG})
        assert r.status_code == 401, (path, headers)
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key" and "param" in err
        assert r.headers["www-authenticate"] == "Bearer" and SERVER_KEY not in r.text
    assert httpx.get(root + "/health").status_code == 200


def test_the_key_opens_every_route(locked):
    root = locked.base_url.removesuffix("/v1")
    bearer = {"Authorization": f"Bearer {SERVER_KEY}"}
    assert httpx.post(root + "/v1/chat/completions", headers=bearer, json={"messages": MSG}).status_code == 200
    assert httpx.post(root + "/v1/responses", headers={"api-key": SERVER_KEY}, json={"input": "hi"}).status_code == 200
    assert httpx.get(root + "/v1/models", headers=bearer).status_code == 200
    assert "gymserve_auth_failures_total" in httpx.get(root + "/metrics", headers=bearer).text
    assert httpx.get(root + "/nope", headers=bearer).status_code == 404


def test_key_comparison_is_constant_time(monkeypatch):
    """The check goes through hmac.compare_digest (never ==), for every request."""
    import hmac

    from gymserve.server import auth

    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    assert auth.presented_key([(b"authorization", b"Bearer abc")]) == b"abc"
    assert auth.presented_key([(b"api-key", b" abc ")]) == b"abc"
    assert auth.presented_key([]) == b""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    mw = auth.ApiKeyMiddleware(app, "abc")
    sent = []

    async def send(msg):
        sent.append(msg)

    import asyncio

    for headers in ([(b"authorization", b"Bearer abc")], [(b"authorization", b"Bearer abd")], []):
        asyncio.run(mw({"type": "http", "path": "/v1/models", "headers": headers}, None, send))
    assert len(calls) == 3 and [m["status"] for m in sent if m["type"] == "http.response.start"] == [200, 401, 401]


def test_cli_server_key_comes_from_the_named_environment_variable(monkeypatch):
    from gymserve.cli import build_parser, serve_overrides
    from gymserve.cli.flags import FlagError

    monkeypatch.setenv("MY_SERVER_KEY", SERVER_KEY)
    monkeypatch.setenv("MY_UPSTREAM_KEY", UPSTREAM_KEY)
    args = build_parser().parse_args(
        [
            "serve",
            "--base-url",
            "http://127.0.0.1:9/v1",
            "--server-api-key-env",
            "MY_SERVER_KEY",
            "--api-key-env",
            "MY_UPSTREAM_KEY",
        ]
    )
    out = serve_overrides(args)
    assert out["server"]["api_key"] == SERVER_KEY and out["backend"]["api_key"] == UPSTREAM_KEY
    args = build_parser().parse_args(["serve", "--server-api-key-env", "NOT_SET_ANYWHERE_42"])
    with pytest.raises(FlagError, match="--server-api-key-env NOT_SET_ANYWHERE_42: that environment variable"):
        serve_overrides(args)


# ------------------------------------------------------------------------------- binding
def test_default_bind_is_loopback():
    assert ServerConfig().host == "127.0.0.1"
    from gymserve.cli import build_parser

    assert build_parser().parse_args(["serve"]).host is None  # no flag: the config's 127.0.0.1


@pytest.mark.parametrize(
    "host, key, warned",
    [
        ("0.0.0.0", None, True),
        ("10.1.2.3", None, True),
        ("0.0.0.0", SERVER_KEY, False),
        ("127.0.0.1", None, False),
        ("localhost", None, False),
    ],
)
def test_binding_beyond_loopback_without_a_key_warns(caplog, host, key, warned):
    from gymserve.server.run import _warn_exposed

    cfg = validate_config(
        {
            "server": {"host": host, **({"api_key": key} if key else {})},
            "backend": {"type": "chat", "base_urls": ["http://127.0.0.1:9/v1"]},
        }
    )
    with caplog.at_level(logging.WARNING, logger="gymserve.server"):
        _warn_exposed(cfg)
    assert (f"binding {host} without a server API key" in caplog.text) is warned


# ------------------------------------------------------------------------------- upstream keys
def test_upstream_key_never_leaks(tmp_path, caplog):
    """Every way out is captured (answers, errors, logs at DEBUG, /metrics, /health, capture) and
    searched for the upstream key, while upstreams misbehave and echo the key back."""

    def echo_key(r):  # a server that puts the credential it received into its error message
        return 500, {"error": {"message": f"internal: got header {r.headers.get('authorization')}"}}

    def echo_401(r):
        return 401, {"error": {"message": f"invalid key {r.headers.get('authorization', '').split()[-1]}"}}

    leaky_ok = lambda r: (200, completion(f"fine (you sent {r.headers.get('authorization')})"))  # noqa: E731
    scripts = [
        ChatScript(name="ok"),
        ChatScript(default=echo_key),
        ChatScript(default=echo_401),
        ChatScript(default=leaky_ok),
    ]
    capture = tmp_path / "capture.jsonl"
    texts = []
    with caplog.at_level(logging.DEBUG):
        for script in scripts:
            with FakeServer(script) as up:
                cfg = _chat_config(up.url, capture_path=str(capture))
                cfg["backend"]["default_query"] = {"api_key": UPSTREAM_KEY}  # a key in the URL, too
                with start_background_server(validate_config(cfg)) as srv:
                    for path, body in (
                        ("/chat/completions", {"messages": MSG}),
                        ("/responses", {"input": "hi"}),
                        ("/chat/completions", {"messages": MSG, "stream": True}),
                        ("/responses", {"input": "hi", "stream": True}),
                    ):
                        r = httpx.post(srv.base_url + path, json=body, timeout=10)
                        assert r.status_code in (200, 502), r.text
                        if script.default is not leaky_ok:  # the model's own words reach the client as sent
                            texts.append(r.text)
                    for path in ("/models", "/../health", "/../metrics"):
                        texts.append(httpx.get(srv.base_url + path).text)
            assert up.requests and all(
                UPSTREAM_KEY in r.headers["authorization"] for r in up.requests if r.path.endswith("/completions")
            )
        # And a replica that is not there at all (connection errors name the URL).
        cfg = _chat_config("http://127.0.0.1:9", capture_path=str(capture))
        cfg["backend"]["default_query"] = {"api_key": UPSTREAM_KEY}
        with start_background_server(validate_config(cfg)) as srv:
            texts.append(httpx.post(srv.base_url + "/chat/completions", json={"messages": MSG}).text)
            texts.append(httpx.get(srv.base_url.removesuffix("/v1") + "/metrics").text)
    texts.append(capture.read_text())
    texts.extend(f"{rec.getMessage()} {rec.exc_text or ''}" for rec in caplog.records)
    assert capture.read_text().count("\n") >= 17
    leaked = [t[:300] for t in texts if UPSTREAM_KEY in t or UPSTREAM_KEY[10:] in t]
    assert not leaked, leaked
    assert "***" in capture.read_text()  # the echoed key was there, and was masked


# ------------------------------------------------------------------------------- body size, base URLs
def test_body_size_limit(upstream):
    with start_background_server(validate_config(_chat_config(upstream.url, max_body_bytes=4096))) as srv:
        big = {"messages": [{"role": "user", "content": "x" * 10_000}]}
        r = httpx.post(srv.base_url + "/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit holds while reading
            for _ in range(100):
                yield b"x" * 1000

        r = httpx.post(srv.base_url + "/responses", content=chunks())
        assert r.status_code == 413 and "limit is 4096" in r.json()["error"]["message"]
        assert httpx.post(srv.base_url + "/chat/completions", json={"messages": MSG}).status_code == 200
    assert not upstream.chat_requests() or all(len(str(r.body)) < 4096 for r in upstream.chat_requests())


def test_base_urls_come_only_from_configuration(upstream):
    with FakeServer(ChatScript(name="evil")) as evil:
        with start_background_server(validate_config(_chat_config(upstream.url))) as srv:
            for key in ("base_url", "base_urls", "api_base", "openai_base_url", "policy_base_url", "url", "endpoint"):
                body = {"messages": MSG, key: evil.url + "/v1", "extra_body": {key: evil.url + "/v1"}}
                headers = {
                    "X-Forwarded-Host": f"127.0.0.1:{evil.port}",
                    "X-Base-URL": evil.url + "/v1",
                    "Forwarded": f"host=127.0.0.1:{evil.port}",
                }
                # A body field naming an upstream is refused (server.known_fields), never followed.
                r = httpx.post(srv.base_url + "/chat/completions", json=body, headers=headers)
                assert r.status_code == 400 and r.json()["error"]["param"] == key
                r = httpx.post(
                    srv.base_url + "/responses", json={"input": "hi", key: evil.url + "/v1"}, headers=headers
                )
                assert r.status_code == 400 and r.json()["error"]["param"] == key
            # The headers alone are ignored: the call goes to the configured upstream.
            r = httpx.post(srv.base_url + "/chat/completions", json={"messages": MSG}, headers=headers)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "from up"
        assert evil.requests == []
        assert len(upstream.chat_requests()) == 1
