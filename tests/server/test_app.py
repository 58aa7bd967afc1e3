"""The HTTP app itself (``server.app``): what every model route does around the backend call,
whatever the backend — here over the local backend with a scripted engine, on a real server."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from gymserve.backends.local import LocalBackend
from gymserve.config import LocalBackendConfig, SamplingConfig, validate_config
from gymserve.server.run import start_background_server
from helpers.fakes import ScriptedEngine

HI = [{"role": "user", "content": "hi"}]
# One long generation per route (the scripted engine repeats its text until max_tokens).
LONG_CALLS = {
    "/v1/chat/completions": {"messages": HI, "max_tokens": 5000},
    "/v1/responses": {"input": "hi", "max_output_tokens": 5000},
    "/v1/messages": {"messages": HI, "max_tokens": 5000},
    "/v1/completions": {"prompt": "hi", "max_tokens": 5000},
}


@contextlib.contextmanager
def _server(tokenizer, engine):
    config = LocalBackendConfig(model="scripted", sampling=SamplingConfig(temperature=0.0))
    cfg = validate_config({"server": {"port": 0}, "backend": config.model_dump()})
    with start_background_server(cfg, backend_factory=lambda: LocalBackend(config, engine, tokenizer)) as srv:
        yield srv


@pytest.mark.parametrize("route", list(LONG_CALLS))
def test_a_client_that_leaves_a_non_streamed_call_stops_its_generation(tokenizer, route):
    """A harness that times out and retries must not leave the abandoned generation running (it
    would hold a batch slot for up to max_tokens steps, and every retry would add one): as vLLM's
    server does for non-streamed calls (``with_cancellation``), the call is cancelled when the
    client disconnects, which ends the engine's generation (streamed calls already stop that way)."""
    engine = ScriptedEngine(tokenizer, "Hello there.", delay=0.01, repeat=True)
    with _server(tokenizer, engine) as srv:
        root = srv.base_url.removesuffix("/v1")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(root + route, json={"model": "scripted", **LONG_CALLS[route]}, timeout=0.5)
        assert engine.started.is_set()
        assert engine.cancelled.wait(5), "the generation kept running after its client left"
        steps = engine.steps
        time.sleep(0.2)
        assert engine.steps == steps and engine.finished == 0
        # The server still answers.
        ok = httpx.post(srv.base_url + "/chat/completions", json={"messages": HI, "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_the_model_call_routes_are_tried_first(tokenizer):
    """Starlette tries routes in order (a regex match each): the docs, control and LoRA routes
    before the model calls cost every call ~40 µs (issue #30)."""
    from gymserve.server.app import _MODEL_CALL_PATHS, create_app

    config = LocalBackendConfig(model="scripted", sampling=SamplingConfig(temperature=0.0))
    app = create_app(LocalBackend(config, ScriptedEngine(tokenizer, "Hi."), tokenizer))
    paths = [getattr(r, "path", None) for r in app.router.routes]
    assert set(paths[: len(_MODEL_CALL_PATHS)]) == _MODEL_CALL_PATHS
    assert {"/pause", "/docs", "/health", "/v1/models", "/tokenize"} <= set(paths)  # the others all still there
