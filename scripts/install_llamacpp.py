"""Install llama-cpp-python (the llamacpp engine) into the running interpreter's environment, with
the build's progress on stdout.

``make install`` runs this with the virtual environment's python, after torch and before gymserve's
extras::

    python scripts/install_llamacpp.py --constraints .venv/torch-constraints.txt

llama-cpp-python ships as a source distribution: pip builds llama.cpp with cmake and the machine's
C++ compiler (about 10 minutes on 2 cores).

The build is **portable**, never tuned to the building machine. llama.cpp's default
(``GGML_NATIVE=ON``, ``-march=native``) compiles in whatever the build machine has — on a current Xeon
that is AMX, whose kernels repack Q4_K weights and crash in the first ``llama_decode``
(ggml-org/llama.cpp#20824) — and a wheel built on one machine runs only there. So this script builds
with :data:`CMAKE_FLAGS`: ``GGML_NATIVE=OFF`` and the x86-64-v3 set (AVX, AVX2, FMA, F16C, BMI2) that
every x86-64 server CPU of the last ten years has, AVX-512 and AMX off. ``GYMSERVE_LLAMA_CMAKE_ARGS``
replaces those flags (for a CPU without AVX2: ``-DGGML_NATIVE=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF
-DGGML_F16C=OFF``). pip's wheel cache is keyed by the source, not by the build flags, so a wheel
that pip cached from a native build would be reused silently: the build runs with
``--no-cache-dir`` into gymserve's own wheel folder, keyed by the requirement, the flags and the
interpreter (``~/.cache/gymserve/llamacpp/<key>/``), and later installs on the machine take that
wheel in seconds.

Why explicit flags and not llama.cpp's runtime CPU dispatch (``GGML_BACKEND_DL`` with
``GGML_CPU_ALL_VARIANTS``, one CPU backend per CPU generation, the best one loaded at run time):
its list of variants includes a Sapphire Rapids one with AMX, which it would pick on exactly the
Xeons that crash; excluding it means patching llama.cpp's CMake lists, and the build compiles the
kernels once per variant, several times the 10 minutes. One x86-64-v3 build costs AVX-512 speed on
the CPUs that have it and runs everywhere else.

``pip install -q`` would show nothing for those minutes, and plain pip only
says "still running"; this script runs ``pip wheel -v`` and turns the build's own step counter
(ninja's ``[N/TOTAL]`` lines) into one line per tenth, with the time spent::

    llama-cpp-python: building llama.cpp from source (once; gymserve keeps the wheel): 103/206 (50%), 4 min 10 s

Already installed at a version the spec accepts **and built portably** (:func:`installed_features`
finds neither AMX nor AVX-512): nothing is run; an AMX or AVX-512 build (pip's native one on such a
CPU) is replaced. A native build on a CPU with neither cannot be told from a portable one. Exit status: pip's (0 on success);
on failure the last 40 lines of pip's output are printed, since they hold the compiler's error.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
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

#: The portable build (see the module docstring): x86-64-v3, no AVX-512, no AMX, no -march=native.
CMAKE_FLAGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
    "-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF "
    "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
)
FLAGS_ENV = "GYMSERVE_LLAMA_CMAKE_ARGS"
#: Features of llama.cpp's ``llama_print_system_info()`` that a portable build must not have.
FORBIDDEN_FEATURES = ("AMX_INT8", "AVX512")


def cmake_flags() -> str:
    """The CMake flags of the build: :data:`CMAKE_FLAGS`, or ``$GYMSERVE_LLAMA_CMAKE_ARGS`` when set."""
    return os.environ.get(FLAGS_ENV) or CMAKE_FLAGS


def wheel_dir(spec: str, flags: str) -> str:
    """gymserve's wheel folder for this requirement, these flags (pip's cache ignores flags) and this
    interpreter (a wheel is built for one Python version and architecture: a venv of another Python
    on the same machine must not be handed it)."""
    interpreter = f"{sys.implementation.cache_tag}-{platform.machine()}"
    key = hashlib.sha256(f"{spec}|{flags}|{interpreter}".encode()).hexdigest()[:16]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gymserve", "llamacpp", key)


def installed_features() -> dict[str, str] | None:
    """``{feature: value}`` from the installed llama.cpp's ``llama_print_system_info()``
    (e.g. ``{"AVX2": "1", "AMX_INT8": "1"}``), or None when llama_cpp does not import. Runs in a
    child process: an AMX build may crash on use, and the import must not touch this one."""
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return None
    return dict(re.findall(r"([A-Z0-9_]+) = (\w+)", probe.stdout))


def unportable(features: dict[str, str]) -> list[str]:
    """The features in ``features`` that a portable build must not have, e.g. ``["AMX_INT8"]``."""
    return [f for f in FORBIDDEN_FEATURES if features.get(f) == "1"]


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
    features = installed_features()
    if features is None:
        return None
    if unportable(features) and not os.environ.get(FLAGS_ENV):
        print(f"llama-cpp-python {version} is installed but built with {unportable(features)}: rebuilding portably")
        return None
    return version


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
                    "llama-cpp-python: building llama.cpp from source (once; gymserve keeps the wheel): "
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
    flags = cmake_flags()
    wheels = wheel_dir(args.spec, flags)
    constraints = ["-c", args.constraints] if args.constraints else []
    install = [sys.executable, "-m", "pip", "install", "--force-reinstall", "--no-deps", "--no-index"]
    if _built(wheels):
        print(f"llama-cpp-python: the portable wheel built earlier on this machine ({wheels})", flush=True)
        return _install_wheel(install, wheels, constraints)
    cmd = [sys.executable, "-m", "pip", "wheel", "-v", "--no-cache-dir", "--no-deps", "-w", wheels, args.spec]
    print(f"llama-cpp-python: CMAKE_ARGS={flags!r}", flush=True)
    print(f"llama-cpp-python: {' '.join(cmd[2:])} (the first build takes about 10 minutes on 2 cores)", flush=True)
    tail: deque[str] = deque(maxlen=40)
    env = {**os.environ, "CMAKE_ARGS": flags, "FORCE_CMAKE": "1"}

    def lines() -> Iterator[str]:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            yield line

    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        for shown in progress(lines()):
            print(shown, flush=True)
    if proc.returncode != 0:
        print("llama-cpp-python: pip failed; its last lines:", *tail, sep="\n", file=sys.stderr)
        return proc.returncode
    return _install_wheel(install, wheels, constraints)


def _built(wheels: str) -> bool:
    return os.path.isdir(wheels) and any(f.startswith("llama_cpp_python") for f in os.listdir(wheels))


def _install_wheel(install: list[str], wheels: str, constraints: list[str]) -> int:
    """Install the llama-cpp-python wheel in ``wheels`` and its dependencies from the index."""
    wheel = [os.path.join(wheels, f) for f in sorted(os.listdir(wheels)) if f.startswith("llama_cpp_python")]
    rc = subprocess.run([*install, *constraints, wheel[-1]]).returncode
    if rc == 0:  # its dependencies (numpy, jinja2, diskcache, typing-extensions) the usual way
        rc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *constraints, wheel[-1]]).returncode
    if rc != 0:
        return rc
    features = installed_features()
    if features is None:  # installed, yet it does not import (or crashes on import): not a success
        print(f"llama-cpp-python: installed from {wheel[-1]}, but `import llama_cpp` fails", file=sys.stderr)
        return 1
    bad = unportable(features)
    shown = " ".join(f"{k}={v}" for k, v in features.items() if k in ("AVX", "AVX2", "AVX512", "AMX_INT8"))
    print(f"llama-cpp-python: installed; llama.cpp reports {shown}")
    if bad and not os.environ.get(FLAGS_ENV):
        print(
            f"llama-cpp-python: the build has {bad}, which a portable build must not; delete {wheels} "
            "and run this script again",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
