"""Regenerate the docs' sample output from real runs on the embedded model.

    python scripts/gen_samples.py            # every sample (a few minutes on 2 cores)
    python scripts/gen_samples.py demo       # one of them

Each sample sits in its page between ``<!-- sample: NAME ... -->`` and ``<!-- end sample: NAME -->``
and is replaced whole; nothing in it is typed by hand:

- ``demo`` (docs/getting-started.md): the standard output of ``gymserve demo``, as printed.
- ``rollout`` (docs/tutorial.md): the tutorial's flow on the embedded model — ``gymserve serve``
  (greedy sampling, so the sample is reproducible) and ``gymserve rollout --base-url`` on the tasks
  file shown in the tutorial, each task capped at 2 model calls; the sample is the first rollout's
  first model call — its output items, training fields in full — and the ``function_call_output``
  the agent appended for it.

Each sample starts with a line saying the machine's core count and load average during the run (the
times in a sample grow with the load of other jobs).

A run that fails (non-zero exit) writes nothing. ``tests/docs/test_docs.py`` checks the committed samples
against the code: the demo's line format (against a demo run on the tiny test model), the model name,
the counts (per-turn token counts against each other and the checks' totals), and the rollout's token
IDs (decoded with the embedded model's tokenizer, they are the prompt and the call shown).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
TUTORIAL = ROOT / "docs" / "tutorial.md"
ROLLOUT_MAX_STEPS = 2
WIDTH = 100


def sample_pattern(name: str) -> re.Pattern[str]:
    """The span of sample ``name`` in a page: group 1 the start marker line, group 2 the body."""
    return re.compile(
        rf"(<!-- sample: {re.escape(name)}\b[^\n]*-->\n)(.*?)(?=<!-- end sample: {re.escape(name)} -->)", re.S
    )


def replace_sample(path: Path, name: str, body: str) -> None:
    """Put ``body`` (ending with a newline) between the markers of sample ``name`` in ``path``.
    Raises SystemExit when the page does not have exactly one such sample."""
    text = path.read_text(encoding="utf-8")
    pattern = sample_pattern(name)
    if len(pattern.findall(text)) != 1:
        raise SystemExit(
            f"gen_samples: {path.relative_to(ROOT)} needs exactly one '<!-- sample: {name} -->' ... "
            f"'<!-- end sample: {name} -->' pair"
        )
    path.write_text(pattern.sub(lambda m: m.group(1) + body, text), encoding="utf-8")
    print(f"wrote sample {name} into {path.relative_to(ROOT)}")


def _gymserve(*args: str) -> str:
    """Run ``gymserve ARGS`` with this interpreter; its stdout (stderr, with progress, passes through)."""
    done = subprocess.run([sys.executable, "-m", "gymserve.cli", *args], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    if done.returncode != 0:
        sys.stdout.write(done.stdout)
        raise SystemExit(f"gen_samples: gymserve {' '.join(args)} exited {done.returncode}; no sample written")
    return done.stdout


def _recorded(build: Callable[[], str]) -> str:
    """``build()``'s fenced block, after a line with the machine's cores and load during the run."""
    before = os.getloadavg()[0]
    block = build()
    note = (
        f"Recorded by `scripts/gen_samples.py` on {os.cpu_count()} cores, load average "
        f"{before:.1f} at the start and {os.getloadavg()[0]:.1f} at the end."
    )
    return f"{note}\n\n{block}"


def demo_sample() -> str:
    return "```text\n" + _gymserve("demo").rstrip("\n") + "\n```\n"


@contextlib.contextmanager
def served(config_text: str) -> Iterator[str]:
    """``gymserve serve --config`` on a free port; yields its base URL once ``/health`` answers 200."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "gymserve.yaml"
        config.write_text(config_text, encoding="utf-8")
        proc = subprocess.Popen(
            [sys.executable, "-m", "gymserve.cli", "serve", "--config", str(config), "--port", str(port)], cwd=ROOT
        )
        try:
            deadline = time.monotonic() + 1800  # a first start converts the model
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"gen_samples: gymserve serve exited {proc.returncode}; no sample written")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("gen_samples: gymserve serve did not become healthy in 30 min")
                time.sleep(2)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            proc.terminate()
            proc.wait(timeout=120)


def tutorial_tasks(path: Path = TUTORIAL) -> list[dict[str, Any]]:
    """The tasks of the tutorial's tasks-file block (the JSON Lines block whose lines hold
    ``responses_create_params``). Raises SystemExit when the page has none."""
    for body in re.findall(r"```json\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
        lines = [line for line in body.splitlines() if line.strip()]
        try:
            tasks = [json.loads(line) for line in lines]
        except ValueError:
            continue
        if tasks and all(isinstance(t, dict) and "responses_create_params" in t for t in tasks):
            return tasks
    raise SystemExit(f"gen_samples: no tasks block in {path.relative_to(ROOT)}")


def first_call_items(rollout: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items of the rollout's first model call (up to the item carrying the training
    fields) and the ``function_call_output`` items answering its calls."""
    output = rollout["output"]
    end = next(i for i, it in enumerate(output) if "prompt_token_ids" in it)
    items = output[: end + 1]
    calls = {it.get("call_id") for it in items if it.get("type") == "function_call"}
    return items + [
        it for it in output[end + 1 :] if it.get("type") == "function_call_output" and it.get("call_id") in calls
    ]


def _wrap(head: str, parts: list[str], tail: str, indent: str) -> list[str]:
    """``head`` + ``parts`` joined by ", " + ``tail``, wrapped at WIDTH with ``indent``."""
    lines, line = [], head
    for i, part in enumerate(parts):
        piece = part + (", " if i < len(parts) - 1 else tail)
        if len(line) + len(piece.rstrip()) > WIDTH and line.strip():
            lines.append(line.rstrip())
            line = indent
        line += piece
    lines.append(line.rstrip())
    return lines


def format_items(items: list[dict[str, Any]]) -> str:
    """JSON for a list of items: scalar fields first, each list field on its own wrapped lines."""
    out = ["["]
    for n, item in enumerate(items):
        scalars = [
            f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in item.items() if not isinstance(v, list)
        ]
        lists = [(k, v) for k, v in item.items() if isinstance(v, list)]
        end = "}" + ("," if n < len(items) - 1 else "")
        out += _wrap("  {", scalars, "," if lists else end, "   ")
        for j, (key, values) in enumerate(lists):
            close = "]" + ("," if j < len(lists) - 1 else end)
            out += _wrap(f"   {json.dumps(key)}: [", [json.dumps(v) for v in values], close, "    ")
    out.append("]")
    return "\n".join(out) + "\n"


ROLLOUT_SERVER_CONFIG = """\
backend:
  type: local
  model: embedded
  sampling: {temperature: 0.0, seed: 0}
"""


def rollout_sample() -> str:
    with tempfile.TemporaryDirectory() as tmp, served(ROLLOUT_SERVER_CONFIG) as base_url:
        tasks_path, out_path = Path(tmp) / "tasks.jsonl", Path(tmp) / "rollouts.jsonl"
        tasks = [{**t, "max_steps": ROLLOUT_MAX_STEPS} for t in tutorial_tasks()]
        tasks_path.write_text("".join(json.dumps(t) + "\n" for t in tasks), encoding="utf-8")
        _gymserve("rollout", "--input", str(tasks_path), "--output", str(out_path), "--base-url", base_url)
        rollouts = {r["id"]: r for r in map(json.loads, out_path.read_text(encoding="utf-8").splitlines())}
    first = rollouts[tasks[0]["id"]]
    items = first_call_items(first)
    return "```json\n" + format_items(items) + "```\n"


SAMPLES = {"demo": (GETTING_STARTED, demo_sample), "rollout": (TUTORIAL, rollout_sample)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "names", nargs="*", metavar="NAME", help=f"samples to regenerate: {', '.join(SAMPLES)} (default: all)"
    )
    names = p.parse_args(argv).names or list(SAMPLES)
    unknown = [n for n in names if n not in SAMPLES]
    if unknown:
        p.error(f"unknown sample {', '.join(unknown)}; choose from {', '.join(SAMPLES)}")
    for name in names:
        path, build = SAMPLES[name]
        replace_sample(path, name, _recorded(build))
    return 0


if __name__ == "__main__":
    sys.exit(main())
