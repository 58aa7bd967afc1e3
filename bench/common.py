"""Shared helpers for the benchmarks: ports, percentiles, CPU time of a process, tables, the
machine line, child processes, the aiohttp load loop, peer virtual environments and results files.

Every benchmark prints ratios against a baseline measured in the same run (absolute numbers on a
shared 2-core machine move by 10% between runs; ratios move much less), and writes its numbers as
JSON under ``docs/assets/perf/`` for ``bench/plot.py`` and ``docs/performance.md``.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "docs" / "assets" / "perf"
TORCH_PIN = "torch==2.13.0"
# The environment the benchmark was started with, before anything in this process changed it (the
# llamacpp engine sets OMP_WAIT_POLICY when it loads): peers run with it (``start_child(caller_env=True)``),
# i.e. as their users run them, not with a setting gymserve chose for itself (issue #30).
CALLER_ENV = dict(os.environ)
# A round is steady when the 1-minute load average moved by at most this much between its start and
# its end and other processes used at most STEADY_OTHER_CORES cores meanwhile (LoadWatch).
STEADY_LOAD_MOVE = 1.0
STEADY_OTHER_CORES = 0.5
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


# ----------------------------------------------------------------------------------- basics
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def cpu_seconds(pid: int, children: bool = True) -> float:
    """User + system CPU seconds of process ``pid`` (and, by default, its live children)."""
    try:
        import psutil

        proc = psutil.Process(pid)
        procs = [proc] + (proc.children(recursive=True) if children else [])
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total
    except ImportError:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks


def rss_mib(pid: int, children: bool = True) -> float:
    """Resident memory of ``pid`` (and its children) in MiB."""
    import psutil

    proc = psutil.Process(pid)
    procs = [proc] + (proc.children(recursive=True) if children else [])
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def cpu_flags() -> list[str]:
    """Which of ``CPU_FLAGS`` (the vector units llama.cpp and torch pick kernels by) this CPU has."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in CPU_FLAGS if flag in have]
    except OSError:
        pass
    return []


def _system_busy_seconds() -> float:
    """CPU seconds all processes have spent busy since boot, summed over cores (``/proc/stat``)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class LoadWatch:
    """Whether the machine stayed quiet while something was measured.

    Records, at construction and at :meth:`end`: the 1-minute load average, the CPU time of this
    process and its children, and the busy CPU time of the whole machine; the difference of the last
    two is what *other* processes used, in cores (busy seconds ÷ wall seconds). ``steady``: the load
    moved by at most ``max_move`` and the others used at most ``max_other_cores``
    (``STEADY_LOAD_MOVE``, ``STEADY_OTHER_CORES``); a round that is not steady is marked so in every
    table (re-run it on a quiet machine before publishing its numbers)."""

    def __init__(self, max_move: float = STEADY_LOAD_MOVE, max_other_cores: float = STEADY_OTHER_CORES):
        self.max_move, self.max_other_cores = max_move, max_other_cores
        self.t0 = time.monotonic()
        self.load0 = os.getloadavg()[0]
        self.own0 = cpu_seconds(os.getpid())
        self.busy0 = _system_busy_seconds()

    def end(self) -> dict[str, Any]:
        """``{"load_start", "load_end", "other_cores", "steady"}`` for the time since construction."""
        wall = max(time.monotonic() - self.t0, 1e-9)
        load1 = os.getloadavg()[0]
        own = cpu_seconds(os.getpid()) - self.own0
        other = max(0.0, (_system_busy_seconds() - self.busy0 - own) / wall)
        steady = abs(load1 - self.load0) <= self.max_move and other <= self.max_other_cores
        return {
            "load_start": round(self.load0, 2),
            "load_end": round(load1, 2),
            "other_cores": round(other, 2),
            "steady": steady,
        }


def steady_text(watch: dict[str, Any]) -> str:
    """``steady`` or ``NOT steady``, with the load and the other processes' cores (``LoadWatch.end``)."""
    word = "steady" if watch.get("steady") else "NOT steady"
    return (
        f"{word} (load {watch['load_start']} → {watch['load_end']}, other processes {watch['other_cores']:.2f} cores)"
    )


_RUN_WATCH: LoadWatch | None = None


def machine() -> dict[str, Any]:
    """What every table states: cores, CPU model and vector flags, Python, the command, the load
    average at the start (and, once ``save_results`` wrote the run, at its end and whether the
    machine stayed quiet: ``LoadWatch`` over the whole run)."""
    global _RUN_WATCH
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    _RUN_WATCH = LoadWatch()
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "cpu_flags": cpu_flags(),
        "python": platform.python_version(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "platform": platform.platform(terse=True),
        "command": " ".join(["python", *sys.argv]),
    }


def machine_line(info: dict[str, Any] | None = None, **extra: Any) -> str:
    info = info or machine()
    flags = info.get("cpu_flags")
    parts = [f"{info['nproc']} cores ({info['cpu']}" + (f"; {', '.join(flags)}" if flags else "") + ")"]
    if "run_watch" in info:
        parts.append(f"whole run {steady_text(info['run_watch'])}")
    else:
        parts.append(f"load {info['loadavg_1m']} at start")
    parts.append(f"Python {info['python']}")
    if info.get("command"):
        parts.append(f"command: `{info['command']}`")
    parts += [f"{k}: {v}" for k, v in extra.items()]
    return "machine: " + "; ".join(parts)


def fmt(x: Any, digits: int = 2) -> str:
    if isinstance(x, float):
        if x != x:  # NaN
            return "-"
        if abs(x) >= 100:
            return f"{x:,.0f}"
        return f"{x:.{digits}f}"
    return str(x)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A plain-text table (also valid Markdown) of ``rows`` under ``headers``."""
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    out = [f"\n{title}"] if title else []
    out.append("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    return "\n".join(out)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def save_results(name: str, data: dict[str, Any]) -> Path:
    """Write ``docs/assets/perf/<name>.json`` (what plot.py and the docs page read)."""
    if _RUN_WATCH is not None and isinstance(data.get("machine"), dict):
        data["machine"]["run_watch"] = _RUN_WATCH.end()  # the load at the end, whether it stayed quiet
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


# ----------------------------------------------------------------------------------- processes
@dataclass
class Child:
    """A server we started (its own process group), with its log file."""

    name: str
    proc: subprocess.Popen
    log: Path
    port: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM to the process group we created for it, SIGKILL after ``timeout`` s."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)


def start_child(
    name: str,
    cmd: Sequence[str],
    port: int,
    *,
    env: dict[str, str | None] | None = None,
    cwd: str | os.PathLike | None = None,
    log_dir: Path | None = None,
    caller_env: bool = False,
) -> Child:
    """Start ``cmd`` in a new session (so ``stop`` ends it and only it), output to a log file.
    ``env`` adds to (a ``None`` value removes from) this process's environment, or with
    ``caller_env`` the one the benchmark was started with (``CALLER_ENV``: how a peer's users run it)."""
    log_dir = log_dir or Path(os.environ.get("TMPDIR", "/tmp")) / "gymserve-bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}-{port}.log"
    fh = open(log, "wb")
    base = CALLER_ENV if caller_env else os.environ
    full_env = {k: v for k, v in {**base, **(env or {})}.items() if v is not None}
    proc = subprocess.Popen(
        list(cmd), stdout=fh, stderr=subprocess.STDOUT, env=full_env, cwd=cwd, start_new_session=True
    )
    fh.close()
    return Child(name, proc, log, port)


def wait_http(child: Child, url: str, timeout: float, *, method: str = "GET", body: bytes | None = None) -> None:
    """Poll ``url`` until it answers (any HTTP status below 500), the child dies, or ``timeout``."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited with {child.proc.returncode} while starting:\n{child.tail()}")
        try:
            req = urllib.request.Request(
                url, data=body, method=method, headers={"content-type": "application/json"} if body else {}
            )
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status < 500:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                return
            last = f"HTTP {exc.code}"
        except Exception as exc:  # noqa: BLE001 - not up yet
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.2)
    child.stop()
    raise TimeoutError(f"{child.name} did not answer {url} within {timeout:.0f} s ({last}):\n{child.tail()}")


def start_fake_chat(port: int | None = None, delay_ms: float = 0.0) -> Child:
    """``bench/fake_chat_server.py`` in its own process; base URL ``http://127.0.0.1:PORT/v1``."""
    port = port or free_port()
    child = start_child(
        "fake-chat",
        [sys.executable, str(ROOT / "bench" / "fake_chat_server.py"), "--port", str(port), "--delay-ms", str(delay_ms)],
        port,
    )
    wait_http(child, f"http://127.0.0.1:{port}/v1/models", 20)
    return child


def gymserve_cmd(*args: str) -> list[str]:
    """``gymserve ...`` with this interpreter (the repository's venv)."""
    return [sys.executable, "-m", "gymserve.cli", *args]


# ----------------------------------------------------------------------------------- load
@dataclass
class LoadResult:
    latencies: list[float]  # seconds, successful requests only
    elapsed: float  # seconds from first send to last answer
    errors: int
    first_error: str | None = None

    @property
    def n(self) -> int:
        return len(self.latencies)

    @property
    def rps(self) -> float:
        return self.n / self.elapsed if self.elapsed > 0 else float("nan")

    def p(self, q: float) -> float:
        return percentile(self.latencies, q)


async def run_load(
    one: Callable[[int], Awaitable[None]], *, requests: int, concurrency: int, time_limit: float
) -> LoadResult:
    """Call ``await one(i)`` ``requests`` times, ``concurrency`` at a time, stopping new calls after
    ``time_limit`` seconds (bounded in count and in time). ``one`` raises on failure."""
    latencies: list[float] = []
    errors = 0
    first_error: str | None = None
    counter = iter(range(requests))
    start = time.perf_counter()
    deadline = start + time_limit

    async def worker() -> None:
        nonlocal errors, first_error
        for i in counter:
            if time.perf_counter() > deadline:
                return
            t0 = time.perf_counter()
            try:
                await one(i)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"[:300]
                if errors > max(10, requests // 10):
                    raise RuntimeError(f"too many errors; first: {first_error}") from exc
                continue
            latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return LoadResult(latencies, time.perf_counter() - start, errors, first_error)


# ----------------------------------------------------------------------------------- peer venvs
def _run(cmd: Sequence[str], what: str, timeout: float) -> None:
    print(f"[setup] {what}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(list(cmd), check=True, timeout=timeout)


def peer_venv(install: bool = True) -> Path | None:
    """``.venv-peer`` with ``transformers serve`` (PEERS.md): torch pinned and installed FIRST,
    then ``transformers[serving]``, accelerate, gguf. Returns the ``transformers`` executable, or
    None when absent and ``install`` is False."""
    venv = ROOT / ".venv-peer"
    exe = venv / "bin" / "transformers"
    if exe.exists():
        return exe
    if not install:
        return None
    if not (venv / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", str(venv)], "peer venv", 300)
    pip = str(venv / "bin" / "pip")
    _run([pip, "install", "-q", TORCH_PIN], "torch first, pinned", 1800)
    _run([pip, "install", "-q", TORCH_PIN, "transformers[serving]", "accelerate", "gguf"], "transformers serve", 1800)
    return exe


def nemo_venv(install: bool = True) -> Path | None:
    """``.venv-nemo`` with NeMo Gym 0.7.0 (PEERS.md): the wheel's own ``Requires-Dist`` without an
    ``extra ==`` marker installed normally, then the wheel with ``--no-deps --ignore-requires-python``
    (it declares Python >= 3.13.14; it runs on 3.11). Returns the ``vllm_model`` app folder, or None."""
    venv = ROOT / ".venv-nemo"
    py = venv / "bin" / "python"
    found = _nemo_app_dir(venv)
    if found:
        return found
    if not install:
        return None
    import tempfile
    import zipfile

    if not py.exists():
        _run([sys.executable, "-m", "venv", str(venv)], "nemo venv", 300)
    tmp = Path(tempfile.mkdtemp(prefix="nemo-wheel-"))
    _run(
        [
            str(venv / "bin" / "pip"),
            "download",
            "-q",
            "--no-deps",
            "--ignore-requires-python",
            "--python-version",
            "3.13",
            "--only-binary=:all:",
            "nemo-gym==0.7.0",
            "-d",
            str(tmp),
        ],
        "nemo-gym wheel",
        600,
    )
    wheel = next(tmp.glob("nemo_gym-0.7.0-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        reqs = [
            line.split(":", 1)[1].strip()
            for line in z.read(meta).decode().splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line
        ]
    _run([str(venv / "bin" / "pip"), "install", "-q", *reqs], "nemo-gym requirements", 3600)
    _run(
        [str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--ignore-requires-python", str(wheel)],
        "nemo-gym wheel",
        600,
    )
    shutil.rmtree(tmp, ignore_errors=True)
    return _nemo_app_dir(venv)


def _nemo_app_dir(venv: Path) -> Path | None:
    for sp in sorted(venv.glob("lib/python3*/site-packages")):
        app = sp / "responses_api_models" / "vllm_model"
        if (app / "app.py").exists():
            return app
    return None
