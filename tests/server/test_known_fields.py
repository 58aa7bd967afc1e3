"""One rule for unknown input (issue #26, symptom 4): a query parameter or a body field that no
route applies is a 400 naming it (``unknown_parameter``), on every route, control routes included;
never 200-and-dropped. The route walk reads the app's own route table and OpenAPI document, so a new
route is covered without editing this test.
"""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from gymserve.server.known_fields import BODY_FIELDS, COMPAT_IGNORED_QUERY, known_body_fields
from helpers.fakes import ChatScript, FakeServer
from helpers.servers import gateway

MSG = [{"role": "user", "content": "hi"}]
BOGUS = "abort_below_start_weight_version"


@pytest.fixture(scope="module")
def chat_gateway():
    with FakeServer(ChatScript(name="up")) as s:
        backend = {"type": "chat", "base_urls": [s.url + "/v1"], "model": "policy", "health_check_interval": 0}
        with gateway(backend) as srv:
            yield srv, s


def _routes(app) -> list[tuple[str, str]]:
    out = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                out.append((method, route.path))
    return out


def test_pause_with_an_unknown_parameter_is_refused_and_does_not_pause(chat_gateway):
    srv, _ = chat_gateway
    root = srv.base_url.removesuffix("/v1")
    r = httpx.post(f"{root}/pause?mode=abort&{BOGUS}=8", timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == BOGUS and r.json()["error"]["code"] == "unknown_parameter"
    assert httpx.get(f"{root}/is_paused", timeout=10).json()["is_paused"] is False
    # vLLM's clear_cache is not applied by gymserve: refused too, never ignored.
    assert httpx.post(f"{root}/pause?clear_cache=true", timeout=10).status_code == 400


def test_every_route_refuses_an_unknown_query_parameter(chat_gateway):
    """Every METHOD path of the app (its route table; the OpenAPI document's paths are a subset)
    answers ``?abort_below_start_weight_version=8`` with a 400 naming it, before the route runs."""
    srv, _ = chat_gateway
    from gymserve.server.app import create_app

    class Stub:  # the routes exist whatever the backend; nothing is called for a refused request
        name = "stub"
        secrets = ()
        limiter = pool = None

    app = create_app(Stub(), control_allowed=True)  # type: ignore[arg-type]
    routes = _routes(app)
    openapi = {(m.upper(), p) for p, ops in TestClient(app).get("/openapi.json").json()["paths"].items() for m in ops}
    assert openapi <= set(routes) and ("POST", "/pause") in routes and ("POST", "/v1/chat/completions") in routes
    root = srv.base_url.removesuffix("/v1")
    for method, path in routes:
        if "{" in path:
            continue
        r = httpx.request(method, f"{root}{path}?{BOGUS}=8", timeout=10)
        assert r.status_code == 400, (method, path, r.status_code, r.text[:200])
        body = r.json()
        message = body["error"]["message"]
        assert BOGUS in message, (method, path, body)
        if not path.startswith("/v1/messages"):
            assert body["error"]["param"] == BOGUS and body["error"]["code"] == "unknown_parameter"
        else:
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


def test_declared_and_compatibility_parameters_still_work(chat_gateway):
    srv, _ = chat_gateway
    root = srv.base_url.removesuffix("/v1")
    assert httpx.post(f"{root}/pause?mode=keep&timeout=5", timeout=10).status_code == 200
    assert httpx.post(f"{root}/resume", timeout=10).status_code == 200
    r = httpx.post(f"{srv.base_url}/chat/completions?api-version=2024-10-21", json={"messages": MSG}, timeout=10)
    assert r.status_code == 200 and ("*", "api-version") in COMPAT_IGNORED_QUERY


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/chat/completions", {"messages": MSG, "prompt_token_ids": [1, 2, 3]}),
        ("/chat/completions", {"messages": MSG, "temprature": 0.5}),
        ("/completions", {"prompt": "hi", "max_tokns": 5}),
        ("/responses", {"input": "hi", "prompt_token_ids": [1, 2]}),
    ],
)
def test_an_unknown_body_field_is_refused_naming_it(chat_gateway, route, body):
    srv, upstream = chat_gateway
    before = len(upstream.requests)
    r = httpx.post(srv.base_url + route, json=body, timeout=10)
    field = next(k for k in body if k not in ("messages", "prompt", "input"))
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert r.json()["error"]["code"] == "unknown_parameter"
    assert len(upstream.requests) == before  # nothing was sent upstream


def test_known_fields_include_the_sdk_fields_and_the_extension_table():
    chat = known_body_fields("chat")
    assert {"messages", "temperature", "max_completion_tokens", "stream_options"} <= chat  # the openai SDK's
    assert BODY_FIELDS["chat"] <= chat and "prompt_token_ids" not in chat
    assert {"input", "max_output_tokens", "previous_response_id"} <= known_body_fields("responses")


@pytest.mark.parametrize("route", ["/messages", "/messages/count_tokens"])
def test_an_unknown_messages_field_is_refused_in_anthropics_shape(chat_gateway, route):
    srv, upstream = chat_gateway
    before = len(upstream.requests)
    body = {"model": "policy", "messages": MSG, "prompt_token_ids": [1, 2]}
    if route == "/messages":
        body["max_tokens"] = 8
    r = httpx.post(srv.base_url + route, json=body, timeout=10)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "prompt_token_ids" in r.json()["error"]["message"]
    assert len(upstream.requests) == before
