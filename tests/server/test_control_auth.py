"""Who may drive the control routes: the server key, an admin key, nobody on an open bind beyond
loopback; and backends without weights of their own answer 501."""

from __future__ import annotations

import httpx
import pytest

from gymserve.config import validate_config
from gymserve.server.control_routes import CONTROL_PATHS, control_allowed
from gymserve.server.run import start_background_server
from helpers.fakes import ChatScript, FakeServer

SERVER_KEY = "gs-server-key-0123456789"
ADMIN_KEY = "gs-admin-key-9876543210"
MSG = [{"role": "user", "content": "hi"}]
CALLS = [
    ("POST", "/pause", {"params": {"mode": "keep"}}),
    ("GET", "/is_paused", {}),
    ("POST", "/resume", {}),
    ("GET", "/weight_info", {}),
    ("POST", "/update_weight_version", {"json": {"new_version": "v2"}}),
    ("POST", "/update_weights", {"json": {"update_info": {"path": "/nowhere"}}}),
    ("POST", "/start_weight_update", {}),
    ("POST", "/finish_weight_update", {"json": {"weight_version": "v2"}}),
]


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture
def upstream():
    with FakeServer(ChatScript(name="up")) as s:
        yield s


def _local(tiny_model_dir, **server):
    cfg = validate_config(
        {"server": {"port": 0, **server}, "backend": {"type": "local", "model": str(tiny_model_dir), "num_threads": 1}}
    )
    return start_background_server(cfg)


def test_the_control_routes_are_the_ones_guarded():
    assert {path for _, path, _ in CALLS} == CONTROL_PATHS


@pytest.mark.parametrize(
    "keys, control_key, model_key",
    [
        ({"api_key": SERVER_KEY}, SERVER_KEY, SERVER_KEY),
        ({"api_key": SERVER_KEY, "admin_api_key": ADMIN_KEY}, ADMIN_KEY, SERVER_KEY),
        ({"admin_api_key": ADMIN_KEY}, ADMIN_KEY, None),
    ],
)
def test_control_routes_need_their_key(tiny_model_dir, keys, control_key, model_key):
    with _local(tiny_model_dir, **keys) as srv:
        root = srv.base_url.removesuffix("/v1")
        wrong = [None, "nope", *({SERVER_KEY, ADMIN_KEY} - {control_key})]
        for method, path, kwargs in CALLS:
            for key in wrong:
                r = httpx.request(method, root + path, headers=_bearer(key), **kwargs)
                assert r.status_code == 401, (path, key, r.text)
                err = r.json()["error"]
                assert err["type"] == "authentication_error" and "admin API key" in err["message"]
                assert SERVER_KEY not in r.text and ADMIN_KEY not in r.text
            r = httpx.request(method, root + path, headers=_bearer(control_key), **kwargs)
            expected = 400 if path == "/update_weights" else 200  # /nowhere is refused, past the key check
            assert r.status_code == expected, (path, r.text)
        assert httpx.get(root + "/weight_info", headers=_bearer(control_key)).json()["weight_version"] == "v2"
        # The model routes keep the server key (an admin key alone leaves them open, as before).
        models = httpx.get(srv.base_url + "/models", headers=_bearer(model_key))
        assert models.status_code == 200
        if model_key is not None:
            assert httpx.get(srv.base_url + "/models", headers=_bearer(ADMIN_KEY)).status_code == 401
        assert httpx.get(root + "/health").json()["weight_version"] == "v2"


def test_without_a_key_the_routes_close_beyond_loopback(upstream, monkeypatch):
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert control_allowed(host)
    for host in ("0.0.0.0", "10.1.2.3", "::", "gpu-node-3"):
        assert not control_allowed(host) and not control_allowed(host, None, "")
        assert control_allowed(host, SERVER_KEY) and control_allowed(host, None, ADMIN_KEY)
    # Served for real on 127.0.0.1 with the decision a 0.0.0.0 bind without a key gets.
    monkeypatch.setattr("gymserve.server.control_routes.control_allowed", lambda host, *keys: False)
    cfg = validate_config({"server": {"port": 0}, "backend": {"type": "chat", "base_urls": [upstream.url + "/v1"]}})
    with start_background_server(cfg) as srv:
        root = srv.base_url.removesuffix("/v1")
        for method, path, kwargs in CALLS:
            r = httpx.request(method, root + path, **kwargs)
            assert r.status_code == 403, (path, r.text)
            err = r.json()["error"]
            assert err["type"] == "permission_error" and err["code"] == "control_closed"
            assert "server.admin_api_key" in err["message"]
        assert httpx.post(srv.base_url + "/chat/completions", json={"model": "m", "messages": MSG}).status_code == 200


def test_a_backend_without_weights_of_its_own_answers_501(upstream):
    """The OpenAI backend (a cloud's weights): every control route is 501. (The chat backend has a
    control plane of its own: a gateway before the trainer's servers, tests/backends/test_chat_control.py.)"""
    cfg = validate_config(
        {
            "server": {"port": 0},
            "backend": {"type": "openai", "base_url": upstream.url + "/v1", "api_key": "k", "model": "policy"},
        }
    )
    with start_background_server(cfg) as srv:
        root = srv.base_url.removesuffix("/v1")
        for method, path, kwargs in CALLS:
            r = httpx.request(method, root + path, **kwargs)
            assert r.status_code == 501, (path, r.text)
            err = r.json()["error"]
            assert err["type"] == "not_supported_error" and err["code"] == "control_not_supported"
            assert "openai backend" in err["message"]
        health = httpx.get(root + "/health").json()
        assert "weight_version" not in health and health["status"] == "ok"
        assert "gymserve_weight_version_info{" not in httpx.get(root + "/metrics").text
