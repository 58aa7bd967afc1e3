"""Install llama-cpp-python (the llamacpp engine) into the running interpreter's environment, with
the build's progress on stdout.

``make install`` runs this with the virtual environment's python, after torch and before gymserve's
extras::

    python scripts/install_llamacpp.py --constraints .venv/torch-constraints.txt

llama-cpp-python ships as a source distribution: pip builds llama.cpp with cmake and the machine's
C++ compiler (about 10 minutes on 2 cores) and caches the wheel, so later installs on the same
machine take seconds. ``pip install -q`` would show nothing for those minutes, and plain pip only
says "still running"; this script runs ``pip install -v`` and turns the build's own step counter
(ninja's ``[N/TOTAL]`` lines) into one line per tenth, with the time spent::

    llama-cpp-python: building llama.cpp from source (once; pip caches the wheel): 103/206 (50%), 4 min 10 s

Already installed at a version the spec accepts: nothing is run. Exit status: pip's (0 on success);
on failure the last 40 lines of pip's output are printed, since they hold the compiler's error.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata

SPEC = "llama-cpp-python>=0.3.36"
STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]\s")
PASS_THROUGH = ("Using cached", "Successfully installed", "Successfully built", "ERROR", "error:")


def satisfied(spec: str = SPEC) -> str | None:
    """The installed llama-cpp-python version when it satisfies ``spec`` and imports, else None."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a fresh venv: pip's own copy
        from pip._vendor.packaging.requirements import Requirement

    req = Requirement(spec)
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return None
    if not req.specifier.contains(version, prereleases=True):
        return None
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, timeout=120)
    return version if probe.returncode == 0 else None


def _elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def progress(lines: Iterable[str], clock: Callable[[], float] = time.monotonic) -> Iterator[str]:
    """Human lines from ``pip install -v`` output: the build's ``[N/TOTAL]`` steps as one line per
    tenth (and the last), pip's cache hits, results and errors as they are."""
    start = clock()
    shown = -1
    for line in lines:
        step = STEP.match(line)
        if step:
            done, total = int(step.group(1)), int(step.group(2))
            tenth = done * 10 // max(total, 1)
            if tenth > shown or done == total:
                shown = tenth
                yield (
                    "llama-cpp-python: building llama.cpp from source (once; pip caches the wheel): "
                    f"{done}/{total} ({100 * done // max(total, 1)}%), {_elapsed(clock() - start)}"
                )
        elif line.lstrip().startswith(PASS_THROUGH):
            yield line.rstrip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default=SPEC, help=f"the requirement to install (default {SPEC!r})")
    p.add_argument("--constraints", help="pip constraints file (torch's pin)")
    args = p.parse_args(argv)
    version = satisfied(args.spec)
    if version:
        print(f"llama-cpp-python {version} is installed ({args.spec}); nothing to do")
        return 0
    cmd = [sys.executable, "-m", "pip", "install", "-v", args.spec]
    if args.constraints:
        cmd[4:4] = ["-c", args.constraints]
    print(f"llama-cpp-python: {' '.join(cmd[2:])} (the first build takes about 10 minutes on 2 cores)", flush=True)
    tail: deque[str] = deque(maxlen=40)

    def lines() -> Iterator[str]:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            yield line

    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for shown in progress(lines()):
            print(shown, flush=True)
    if proc.returncode != 0:
        print("llama-cpp-python: pip failed; its last lines:", *tail, sep="\n", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
