"""The chat backend against a REAL third-party chat server: ``transformers serve`` on the embedded
model's safetensors copy, in its own virtual environment ``.venv-peer`` (built here when missing;
torch is installed first and pinned so pip never pulls a CUDA build). It stands in for a remote
vLLM started without parsers: no token IDs, raw text. Two short requests only (CPU, 2 cores).
The ``transformers_serve`` session fixture lives in ``conftest.py`` (also used by
``test_stream_backends.py``)."""

from __future__ import annotations

import pytest

from gymserve.backends import RequestContext, build_backend
from gymserve.config import validate_config

pytestmark = pytest.mark.real_model


async def test_chat_and_responses_through_transformers_serve(transformers_serve):
    base_url, model = transformers_serve
    backend = build_backend(
        validate_config(
            {
                "backend": {
                    "type": "chat",
                    "base_urls": base_url,
                    "model": model,
                    "served_model_name": "policy",
                    "timeout": 120,
                }
            }
        )
    )
    try:
        assert model in await backend.upstream_models()
        out = await backend.chat(
            {"model": "policy", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0},
            RequestContext(session_id="s"),
        )
        choice = out["choices"][0]
        assert out["model"] == "policy" and choice["finish_reason"] in ("stop", "length")
        assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
        resp = await backend.responses(
            {"model": "policy", "input": "Say hi", "max_output_tokens": 8, "temperature": 0},
            RequestContext(session_id="s"),
        )
        assert resp["status"] in ("completed", "incomplete") and resp["output"][-1]["type"] == "message"
        assert resp["output"][-1]["content"][0]["text"]
    finally:
        await backend.close()
