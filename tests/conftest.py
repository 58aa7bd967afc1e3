"""Shared fixtures: the embedded model's real tokenizer, a tiny random-weight Qwen2 model that
uses it (fast tests), the real embedded model (few, short tests), and a real ``transformers serve``
chat server on it (``transformers_serve``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    """The safetensors copy of the embedded model (built on first use, ~1-2 min, then cached)."""
    from gymserve.engine.model_store import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_dir))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_dir) -> Path:
    """A 2-layer random-weight Qwen2 model with the embedded model's real tokenizer and template."""
    from helpers.tiny_model import build_tiny_model

    # Named like the embedded model so `auto` picks the same tool-call parser for both.
    return build_tiny_model(tmp_path_factory.mktemp("Qwen2.5-Coder-tiny"), embedded_dir)


@pytest.fixture(scope="session")
def tiny_gguf_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model's weights as an F32 GGUF (``model.gguf``) beside the same tokenizer files: the
    llamacpp engine's tiny model, comparable token for token with ``tiny_model_dir``. Skips when
    llama-cpp-python is not installed."""
    import shutil

    pytest.importorskip(
        "llama_cpp", reason='the llamacpp engine needs llama-cpp-python: pip install "gymserve[llamacpp]"'
    )
    from helpers.tiny_gguf import write_gguf_of_hf_model

    out = tmp_path_factory.mktemp("Qwen2.5-Coder-tiny-gguf")
    write_gguf_of_hf_model(tiny_model_dir, out / "model.gguf")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tiny_model_dir / name).exists():
            shutil.copy(tiny_model_dir / name, out / name)
    return out


LOCAL_ENGINES = ("transformers", "llamacpp")


@pytest.fixture(scope="module", params=LOCAL_ENGINES)
def local_engine(request) -> tuple[str, Path]:
    """``(engine, tiny model for it)`` for each in-process CPU engine: the token-exactness tests run on
    all of them (the transformers engine on ``tiny_model_dir``, llamacpp on ``tiny_gguf_dir``)."""
    if request.param == "llamacpp":
        return "llamacpp", request.getfixturevalue("tiny_gguf_dir")
    return "transformers", request.getfixturevalue("tiny_model_dir")


# ---------------------------------------------------------------- transformers serve (a real chat server)
ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / ".venv-peer"
PEER_BIN = PEER / "bin" / "transformers"


def _build_peer_venv() -> str | None:
    """Create .venv-peer if needed; returns None on success or the reason it could not be built."""
    if PEER_BIN.exists():
        return None
    pip = str(PEER / "bin" / "pip")
    steps = [
        [sys.executable, "-m", "venv", str(PEER)],
        [pip, "install", "-q", "torch==2.13.0"],  # first and pinned: a looser torch pulls CUDA wheels
        [pip, "install", "-q", "transformers[serving]", "accelerate"],
    ]
    for step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{' '.join(step[:3])} failed: {exc}"
        if done.returncode != 0:
            return f"{' '.join(step[:3])} failed: {done.stderr.strip()[-300:]}"
    return None if PEER_BIN.exists() else "transformers CLI missing after install"


@pytest.fixture(scope="session")
def transformers_serve(embedded_dir):
    """``(base_url, model_name)`` of a running ``transformers serve`` (stopped at session end): the
    embedded model's safetensors copy served from ``.venv-peer`` (built on first use)."""
    import httpx

    from helpers.fakes import free_port

    reason = _build_peer_venv()
    if reason is not None:
        pytest.skip(f"cannot build .venv-peer for transformers serve: {reason}")
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    log = (
        open(ROOT / ".pytest_cache" / "transformers-serve.log", "w")
        if (ROOT / ".pytest_cache").is_dir()
        else subprocess.DEVNULL
    )
    proc = subprocess.Popen(
        [str(PEER_BIN), "serve", str(embedded_dir), "--port", str(port), "--host", "127.0.0.1"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited with {proc.returncode} before answering /health")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("transformers serve did not become healthy within 300 s")
            time.sleep(1)
        yield url + "/v1", str(embedded_dir)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log is not subprocess.DEVNULL:
            log.close()


@pytest.fixture
def openai_fake():
    """A fake OpenAI API on 127.0.0.1 (``fakes.openai_handler``), key ``fakes.CLOUD_KEY``, model ``gpt-test``."""
    from helpers.fakes import CLOUD_KEY, FakeServer, openai_handler

    with FakeServer(openai_handler(CLOUD_KEY, model="gpt-test")) as s:
        yield s


@pytest.fixture
def azure_fake():
    """A fake Azure OpenAI resource on 127.0.0.1 (``fakes.azure_handler``), key ``fakes.CLOUD_KEY``,
    ``api-version`` ``fakes.AZURE_VERSION``, deployment ``dep``."""
    from helpers.fakes import AZURE_VERSION, CLOUD_KEY, FakeServer, azure_handler

    with FakeServer(azure_handler(api_key=CLOUD_KEY, api_version=AZURE_VERSION, deployment="dep")) as s:
        yield s


@pytest.fixture
def anthropic_fake():
    """A fake Anthropic Messages API on 127.0.0.1 (``fakes.anthropic_handler``), key ``fakes.CLOUD_KEY``,
    model ``claude-test``."""
    from helpers.fakes import CLOUD_KEY, FakeServer, anthropic_handler

    with FakeServer(anthropic_handler(CLOUD_KEY, model="claude-test")) as s:
        yield s


# ---------------------------------------------------------------- the model cache (tests/helpers/fake_store.py)
@pytest.fixture
def model_cache(tmp_path, monkeypatch) -> Path:
    """An empty model cache: ``GYMSERVE_CACHE`` points at a directory not created yet."""
    path = tmp_path / "cache"
    monkeypatch.setenv("GYMSERVE_CACHE", str(path))
    return path


@pytest.fixture
def fake_wheels(tmp_path, model_cache, monkeypatch) -> dict:
    """The embedded model's wheels replaced by six synthetic ones (1 MB) and its conversion by a fake."""
    from helpers.fake_store import install, make_wheels, unique_prefix

    spec = make_wheels(tmp_path / "wheels", os.urandom(1 << 20), prefix=unique_prefix("fake"))
    return install({**spec, "convert": "fake", "delay": 0.05}, monkeypatch)


# ---------------------------------------------------------------- a local server and a chat backend in front of it
@pytest.fixture(scope="session")
def tiny_local_server(tiny_model_dir):
    """A gymserve on the tiny model (local backend, seeded sampling, 512-token window), shared by the
    tests of the token routes (completions, /tokenize, n > 1, required prefix)."""
    from gymserve.backends.local import LocalBackend
    from gymserve.config import GymserveConfig, LocalBackendConfig, SamplingConfig, ServerConfig
    from gymserve.server.run import start_background_server

    cfg = GymserveConfig(
        server=ServerConfig(port=0),
        backend=LocalBackendConfig(
            model=str(tiny_model_dir), sampling=SamplingConfig(temperature=1.0, seed=5), max_model_len=512
        ),
    )
    srv = start_background_server(cfg, backend_factory=lambda: LocalBackend.from_config(cfg.backend))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tiny_gateway(tiny_local_server):
    """A gymserve whose chat backend (``return_token_id_information``) is ``tiny_local_server``: a
    real OpenAI-compatible upstream that serves /v1/completions, /tokenize and token fields."""
    from gymserve.config import validate_config
    from gymserve.server.run import start_background_server

    cfg = validate_config(
        {
            "server": {"port": 0},
            "backend": {
                "type": "chat",
                "base_urls": [tiny_local_server.base_url],
                "return_token_id_information": True,
                "max_retries": 0,
                "timeout": 120,
            },
        }
    )
    srv = start_background_server(cfg)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tiny_local_client(tiny_local_server):
    """The official openai SDK client of ``tiny_local_server``."""
    import openai

    return openai.OpenAI(base_url=tiny_local_server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def tiny_gateway_client(tiny_gateway):
    """The official openai SDK client of ``tiny_gateway``."""
    import openai

    return openai.OpenAI(base_url=tiny_gateway.base_url, api_key="unused", max_retries=0)
