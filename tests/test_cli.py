"""The ``gymserve`` command as a user meets it: ``vllm serve``-style flags that land in the config,
a server that says "serving" only once it answers, a port clash that names ``--port``, and
failures that print one clear line (the traceback goes to a file, or to stderr with ``--debug``).

Servers run as real ``gymserve serve`` subprocesses on 127.0.0.1 with the tiny model, driven by the
official openai SDK; flag-to-config mapping is checked in process through ``cli.main`` and
``cli.config_from_args``.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from importlib.metadata import version as dist_version
from pathlib import Path

import httpx
import openai
import pytest

import gymserve
from gymserve import cli
from gymserve.cli.flags import SERVE_FLAGS, FlagError
from gymserve.config import RayBackendConfig
from gymserve.server.run import BindError, start_background_server

ROOT = Path(__file__).resolve().parents[1]
KEY = "gs-cli-key-5f4e3d2c1b"


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **extra}
    env.pop("GYMSERVE_API_KEY", None)
    env.pop("GYMSERVE_DEBUG", None)
    return env


def _gymserve(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gymserve.cli", *argv],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        cwd=ROOT,
        **kwargs,
    )


def _config(*argv: str, flags=SERVE_FLAGS, **kwargs):
    args = cli.build_parser().parse_args(list(argv))
    return cli.config_from_args(args, flags, **kwargs)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("GYMSERVE_API_KEY", raising=False)
    monkeypatch.delenv("GYMSERVE_DEBUG", raising=False)


# ------------------------------------------------------------------------------------ version
def test_version_prints_the_installed_version():
    done = _gymserve("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"gymserve {gymserve.__version__}"
    assert cli.version() == gymserve.__version__ == dist_version("gymserve")  # one source, and the installed one


# ------------------------------------------------------------------------- no prefix matching
def test_no_option_is_matched_by_a_prefix(capsys):
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert parser.allow_abbrev is False
    assert {name: p.allow_abbrev for name, p in subparsers.choices.items()} == dict.fromkeys(subparsers.choices, False)
    # The case: `--api-key abc` once became `--api-key-env abc`; now it is the server's key ...
    args = parser.parse_args(["serve", "--api-key", "abc"])
    assert (args.api_key, args.api_key_env) == ("abc", None)
    # ... and an abbreviation of --api-key-env is an error, not a guess.
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--api-key-e", "HOME"])
    assert exc.value.code == 2 and "unrecognized arguments: --api-key-e" in capsys.readouterr().err


# ----------------------------------------------------------------------- flags -> config keys
def test_positional_model_and_its_alias(tmp_path):
    assert _config("serve", str(tmp_path)).backend.model == str(tmp_path)
    assert _config("serve", "--model", str(tmp_path)).backend.model == str(tmp_path)
    assert _config("serve").backend.model == "embedded"
    remote = _config("serve", "policy", "--base-url", "http://127.0.0.1:9/v1", "--base-url", "http://127.0.0.1:10/v1")
    assert (remote.backend.type, remote.backend.model) == ("chat", "policy")
    assert remote.backend.base_urls == ["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"]
    with pytest.raises(FlagError, match=r"the model is given twice \('a' and --model 'b'\)"):
        _config("serve", "a", "--model", "b")


def test_engine_and_sampling_flags_land_in_the_config(tmp_path):
    c = _config(
        "serve",
        str(tmp_path),
        "--max-model-len",
        "2k",
        "--seed",
        "7",
        "--temperature",
        "0",
        "--top-p",
        "0.9",
        "--top-k",
        "20",
        "--stop-token-ids",
        "5",
        "6",
        "--min-p",
        "0.05",
        "--pin-sampling",
        "override",
        "--max-num-seqs",
        "3",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
    )
    b = c.backend
    assert (b.max_model_len, b.max_num_seqs, b.tool_call_parser, b.reasoning_parser) == (2000, 3, "hermes", "qwen3")
    s = b.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.stop_token_ids, s.pin) == (
        0.0,
        0.9,
        20,
        0.05,
        7,
        [5, 6],
        "override",
    )
    assert _config("serve", "--pin-sampling").backend.sampling.pin == "reject"  # the bare switch pins
    assert _config("serve").backend.sampling.pin == "off"
    assert _config("serve", "--max-model-len", "32K").backend.max_model_len == 32768
    assert _config("serve", "--max-model-len", "4096").backend.max_model_len == 4096
    gpu = _config("serve", "--engine", "vllm", "-tp", "2", "--gpu-memory-utilization", "0.8")
    assert gpu.backend.engine_args == {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.8}
    cpu = _config("serve", "--engine", "vllm", "--dtype", "float32", "--enforce-eager")
    assert cpu.backend.engine_args == {"dtype": "float32", "enforce_eager": True}  # vllm serve's flags


def test_vllm_engine_flags_with_another_engine_are_named(capsys):
    assert cli.main(["serve", "--dtype", "float32"]) == 2
    assert "--dtype applies to the vllm engines, not transformers" in capsys.readouterr().err
    assert cli.main(["serve", "--engine", "llamacpp", "--enforce-eager"]) == 2
    assert "--enforce-eager applies to the vllm engines, not llamacpp" in capsys.readouterr().err


def test_python_dash_m_gymserve_is_the_command():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "gymserve", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "serve" in done.stdout


def test_flags_override_the_file_and_keep_the_rest_of_it(tmp_path):
    path = tmp_path / "gymserve.yaml"
    path.write_text(
        "server: {port: 9001}\nbackend:\n  type: local\n  max_model_len: 256\n  sampling: {temperature: 0.5, seed: 1}\n"
    )
    c = _config("serve", "--config", str(path), "--seed", "9", "--port", "9002")
    assert (c.backend.max_model_len, c.backend.sampling.temperature, c.backend.sampling.seed) == (256, 0.5, 9)
    assert c.server.port == 9002


def test_training_field_switch_and_served_names_for_a_chat_backend(tmp_path):
    c = _config(
        "serve",
        "policy",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--return-token-id-information",
        "--served-model-name",
        "public",
        "old-name",
    )
    assert c.backend.return_token_id_information is True
    assert (c.backend.served_model_name, c.served_model_names) == ("public", ["public", "old-name"])
    path = tmp_path / "chat.yaml"
    path.write_text("backend: {type: chat, base_urls: [http://127.0.0.1:9/v1], return_token_id_information: true}\n")
    assert (
        _config("serve", "--config", str(path), "--no-return-token-id-information").backend.return_token_id_information
        is False
    )


def test_a_flag_for_another_backend_is_named_not_ignored(capsys):
    url = "http://127.0.0.1:9/v1"
    assert cli.main(["serve", "--base-url", url, "--temperature", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gymserve serve: --temperature does not apply to the chat backend") and "upstream" in err
    assert cli.main(["serve", "--api-key-env", "HOME"]) == 2
    assert "--api-key-env does not apply to the local backend" in capsys.readouterr().err
    assert cli.main(["serve", "--base-url", url, "--replicas", "2"]) == 2
    assert "--base-url does not apply to the ray backend" in capsys.readouterr().err
    assert cli.main(["serve", "-tp", "2"]) == 2
    assert "--tensor-parallel-size applies to the trtllm and vllm engines, not transformers" in capsys.readouterr().err
    assert cli.main(["serve", "--api-key", "a", "--server-api-key-env", "HOME"]) == 2
    assert "--api-key and --server-api-key-env both set server.api_key" in capsys.readouterr().err


def test_server_key_from_flag_env_var_or_file(monkeypatch, tmp_path):
    monkeypatch.setenv("MY_KEY", "from-named-env")
    assert _config("serve", "--api-key", KEY).server.api_key.get_secret_value() == KEY
    assert _config("serve", "--server-api-key-env", "MY_KEY").server.api_key.get_secret_value() == "from-named-env"
    assert _config("serve").server.api_key is None
    monkeypatch.setenv("GYMSERVE_API_KEY", "from-gymserve-env")
    assert _config("serve").server.api_key.get_secret_value() == "from-gymserve-env"
    assert _config("serve", "--api-key", KEY).server.api_key.get_secret_value() == KEY  # the flag wins
    path = tmp_path / "c.yaml"
    path.write_text("server: {api_key: from-file}\n")
    assert _config("serve", "--config", str(path)).server.api_key.get_secret_value() == "from-file"  # the file too
    # The upstream key is another flag and another key.
    monkeypatch.setenv("UP_KEY", "sk-up")
    c = _config("serve", "m", "--base-url", "http://127.0.0.1:9/v1", "--api-key-env", "UP_KEY", "--api-key", KEY)
    assert (c.backend.api_key.get_secret_value(), c.server.api_key.get_secret_value()) == ("sk-up", KEY)


def test_launch_takes_the_same_flags_for_its_replicas(tmp_path):
    from gymserve.ray_cluster.cli import launch_flags

    path = tmp_path / "ray.yaml"
    path.write_text("backend:\n  type: ray\n  local: {sampling: {temperature: 0.5}}\n")
    c = _config(
        "launch",
        str(tmp_path),
        "--config",
        str(path),
        "--replicas",
        "2",
        "--seed",
        "3",
        "--max-model-len",
        "1024",
        "--served-model-name",
        "policy",
        "--api-key",
        KEY,
        flags=launch_flags(),
        kind="ray",
    )
    assert isinstance(c.backend, RayBackendConfig) and c.backend.replicas == 2
    local = c.backend.local
    assert (local.model, local.max_model_len, local.sampling.temperature, local.sampling.seed) == (
        str(tmp_path),
        1024,
        0.5,
        3,
    )
    assert c.served_model_names == ["policy"] and c.server.api_key.get_secret_value() == KEY
    serve = _config(
        "serve", "--replicas", "3", "--temperature", "0", flags=SERVE_FLAGS + _serve_ray_flags(), kind="ray"
    )
    assert (serve.backend.replicas, serve.backend.local.sampling.temperature) == (3, 0.0)


def _serve_ray_flags():
    from gymserve.ray_cluster.cli import serve_ray_flags

    return serve_ray_flags()


# --------------------------------------------------------------- a real server, started honestly
class _Lines:
    """stderr of a child, line by line, read in a thread."""

    def __init__(self, stream):
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream):
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                return None
            self.seen.append(line)
            match = re.search(pattern, line)
            if match:
                return match
        return None


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """``gymserve serve TINY --port 0 ...`` as a user types it; yields (base_url, the 'serving' line)."""
    argv = [
        sys.executable,
        "-m",
        "gymserve.cli",
        "serve",
        str(tiny_model_dir),
        "--port",
        "0",
        "--api-key",
        KEY,
        "--served-model-name",
        "policy",
        "policy-v0",
        "--max-model-len",
        "384",
        "--temperature",
        "0",
        "--pin-sampling",
    ]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=_env(), cwd=ROOT)
    out = _Lines(proc.stderr)
    try:
        match = out.wait_for(r"serving .* on (http://127\.0\.0\.1:(\d+)/v1)$", timeout=240)
        # The moment the line is read, the port must answer: no retry, no sleep.
        health = httpx.get(match.group(1).removesuffix("/v1") + "/health", timeout=10) if match else None
        if match is None:
            pytest.fail("gymserve serve printed no 'serving' line:\n" + "".join(out.seen))
        yield match.group(1), out.seen, health
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_serving_line_comes_once_the_port_answers(served):
    base_url, lines, health = served
    assert health.status_code == 200 and health.json()["context_window"] == 384  # --max-model-len reached the engine
    assert not base_url.endswith(":0/v1")  # --port 0: the line names the port actually bound
    assert lines[-1] == f"gymserve: serving policy, also as policy-v0 (local backend) on {base_url}\n"
    starting = [i for i, line in enumerate(lines) if "gymserve: starting the local backend" in line]
    assert starting and starting[0] < len(lines) - 1  # "starting" came first, "serving" last
    assert "Errno" not in "".join(lines)


def test_api_key_flag_locks_the_real_server(served):
    base_url = served[0]
    bare = httpx.get(base_url + "/models", timeout=10)
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()


def test_served_model_names_in_models_and_answers(served):
    client = openai.OpenAI(base_url=served[0], api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["policy", "policy-v0"]
    chat = client.chat.completions.create(model="policy-v0", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.model == "policy"
    response = client.responses.create(model="policy", input="Hi", max_output_tokens=3)
    assert response.model == "policy"
    # --pin-sampling fixes --temperature 0: a request asking for another is refused, naming the field.
    with pytest.raises(
        openai.BadRequestError, match="temperature=0.7 differs from the server's pinned temperature=0.0"
    ):
        client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0.7
        )


def test_busy_port_exits_naming_the_flag_before_loading_anything(tiny_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _gymserve("serve", str(tiny_model_dir), "--port", str(port))
        with pytest.raises(BindError, match=f"port {port} is already in use.*--port"):
            start_background_server(_config("serve", "--port", str(port)))
    assert done.returncode == 2
    err = done.stderr.strip()
    assert f"cannot listen on 127.0.0.1:{port}: port {port} is already in use" in err
    assert "pass another --port" in err and f"ss -ltnp 'sport = :{port}'" in err
    assert "Errno" not in err and "Traceback" not in err and "gymserve: serving" not in err
    assert err.splitlines()[-1].startswith("gymserve serve: cannot listen")


# ------------------------------------------------------------------------- failures, one line each
@pytest.fixture
def crashing_store(monkeypatch, tmp_path):
    """``gymserve demo`` meets a bug while preparing the model (the issue's fresh-cache TypeError)."""
    import gymserve.engine.model_store as store

    def resolve_model(spec):
        raise TypeError("expected str, bytes or os.PathLike object, not NoneType")

    monkeypatch.setattr(store, "resolve_model", resolve_model)
    monkeypatch.setattr("gymserve.engine.gguf_store.resolve_gguf_model", resolve_model)  # never a real demo
    monkeypatch.setenv("GYMSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "logs"


def test_an_unexpected_error_is_one_line_and_a_traceback_file(crashing_store, capsys):
    assert cli.main(["demo", "--engine", "transformers"]) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    # What failed and where: the step that called the (here broken) model store for the demo.
    assert re.match(
        r"gymserve demo: unexpected error at gymserve/engine/__init__\.py:\d+ in resolve_engine_model: TypeError: "
        r"expected str, bytes or os\.PathLike object, not NoneType; ",
        lines[0],
    ), lines[0]
    logs = list(crashing_store.glob("demo-*.log"))
    assert len(logs) == 1 and f"the full traceback is in {logs[0]}" in lines[0] and "--debug" in lines[0]
    text = logs[0].read_text()
    assert "Traceback (most recent call last)" in text and "TypeError: expected str" in text and "run_demo" in text


def test_debug_prints_the_traceback(crashing_store, capsys):
    assert cli.main(["demo", "--engine", "transformers", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "TypeError: expected str" in err
    assert err.strip().splitlines()[-1].startswith("gymserve demo: unexpected error at")
    assert not crashing_store.exists()  # printed, not written
    assert cli.main(["--debug", "demo", "--engine", "transformers"]) == 1  # before the command too
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_known_errors_keep_their_message(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GYMSERVE_CACHE", str(tmp_path / "cache"))
    assert cli.main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err == f"gymserve serve: config file not found: {tmp_path / 'missing.yaml'}\n"
    bad = tmp_path / "bad.yaml"
    bad.write_text("backend: {type: chat, base_urls: [localhost:8000/v1]}\n")
    assert cli.main(["check", "--config", str(bad)]) == 2
    assert (
        "gymserve check: invalid configuration:\n  backend.base_urls: base_urls must start with http://"
        in capsys.readouterr().err
    )
    # An upstream that does not answer: the URL and the cause, no exception class on its own.
    assert cli.main(["demo", "--base-url", "http://127.0.0.1:9/v1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gymserve demo: cannot reach http://127.0.0.1:9/v1/models (") and "Traceback" not in err
    assert not (tmp_path / "cache" / "logs").exists()
