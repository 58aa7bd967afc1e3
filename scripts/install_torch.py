"""Install torch into the running interpreter's environment as its CPU build, then pin it.

``make install`` runs this with the virtual environment's python, before gymserve's extras::

    python scripts/install_torch.py --torch torch==2.13.0 --index https://download.pytorch.org/whl/cpu \\
        --try-local --constraints .venv/torch-constraints.txt
    python scripts/install_torch.py --check --constraints .venv/torch-constraints.txt

Why: on PyPI the Linux ``torch`` wheel is the CUDA build, and installing it pulls ~19 ``nvidia-*``
and ``triton`` packages (several GB). The CPU build (``2.13.0+cpu``, ~190 MB) lives on PyTorch's own
index, ``https://download.pytorch.org/whl/cpu`` (the URL PyTorch's "Get started" page gives for
``pip install torch --index-url ...``). Order of attempts:

1. ``--try-local``: ``pip install --no-index --no-deps SPEC`` takes a wheel pip finds without an
   index (its ``find-links`` directories, e.g. ``PIP_FIND_LINKS=/wheels``); torch's own small
   dependencies (filelock, sympy, networkx, ...) then come from the default index.
2. Otherwise ``pip install --index-url INDEX SPEC`` (torch and its dependencies from that index).
3. ``--torch ''`` (``make install TORCH=``): install nothing; use the torch already in the
   environment (a CUDA or ROCm build the user installed), or stop if there is none.

Afterwards the installed build is reported (``torch.version.cuda is None`` and no HIP: CPU build;
otherwise which GPU build it is, and how to get the CPU one) and ``--constraints FILE`` gets
``torch==<installed version>``: ``pip install -c FILE -e ".[local]"`` then cannot replace it.
``--check`` only compares the installed torch with that file (after the extras are installed).

Exit status: 0 on success (a GPU build is a warning, not an error: it was asked for or found
locally, and it also runs on the CPU); 1 when torch could not be installed, or when the installed
torch is not the pinned one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
_PROBE = (
    "import json, torch; print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda, "
    "'hip': getattr(torch.version, 'hip', None), 'path': torch.__file__}))"
)


def _say(text: str) -> None:
    print(f"install_torch: {text}", flush=True)


def _pip(*args: str, quiet_failure: bool = False) -> bool:
    """Run ``python -m pip install -q ARGS``; True on success. ``quiet_failure``: an attempt that may
    miss (no local wheel), so pip's output is not shown."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", *args]
    if quiet_failure:
        return subprocess.run(cmd, capture_output=True, text=True).returncode == 0
    return subprocess.run(cmd).returncode == 0


def installed_torch_version() -> str | None:
    """The version of the torch distribution installed in this environment (None: none)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def describe_build(info: dict) -> tuple[bool, str]:
    """``(is_cpu_build, sentence)`` for a probe result ``{"version", "cuda", "hip", "path"}``."""
    if info.get("cuda"):
        return False, f"torch {info['version']} is a CUDA {info['cuda']} build, not the CPU build"
    if info.get("hip"):
        return False, f"torch {info['version']} is a ROCm {info['hip']} build, not the CPU build"
    return True, f"torch {info['version']} is a CPU build (torch.version.cuda is None)"


def install(spec: str, index: str, try_local: bool) -> str:
    """Install ``spec``; return where it came from. Raises SystemExit(1) with the reason."""
    before = installed_torch_version()
    if try_local and _pip("--no-index", "--no-deps", spec, quiet_failure=True):
        version = installed_torch_version()
        if version == before:
            return "the environment (already installed)"
        # torch's own dependencies are small pure-Python packages: any index has them.
        if not _pip(f"torch=={version}"):
            raise SystemExit(
                f"install_torch: torch {version} was installed from a local wheel, but its "
                "dependencies could not be installed (pip's message above)"
            )
        return "a local wheel that pip found without an index (its find-links)"
    if try_local:
        _say(f"no local wheel for {spec} (pip --no-index found none); installing it from {index}")
    if not _pip("--index-url", index, spec):
        raise SystemExit(
            f"install_torch: pip could not install {spec} from {index} (pip's message above). "
            "If this machine cannot reach that index, put the CPU wheel in a directory and set "
            f"PIP_FIND_LINKS=DIR, set TORCH_INDEX to a mirror of {CPU_INDEX}, or install torch "
            "yourself into the venv and run make install TORCH="
        )
    return index


def probe() -> dict:
    """Import torch in a fresh interpreter (it may have been installed after this one started)."""
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"install_torch: torch is installed but does not import:\n{done.stderr.strip()}")
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--torch", default="torch==2.13.0", help="pip requirement for torch; empty: keep the torch already installed"
    )
    p.add_argument("--index", default=CPU_INDEX, help=f"index to install from (default {CPU_INDEX})")
    p.add_argument("--try-local", action="store_true", help="first try a wheel pip finds without an index")
    p.add_argument("--constraints", required=True, type=Path, help="file to write torch==<installed> to")
    p.add_argument("--check", action="store_true", help="only check that torch is still the pinned version")
    args = p.parse_args(argv)

    if args.check:
        pinned = args.constraints.read_text(encoding="utf-8").strip().removeprefix("torch==")
        now = installed_torch_version()
        if now != pinned:
            _say(
                f"torch changed from {pinned} to {now} while installing gymserve's extras; remove the venv "
                "and run make install again"
            )
            return 1
        _say(f"torch {now} unchanged after installing gymserve")
        return 0

    if args.torch.strip():
        source = install(args.torch, args.index, args.try_local)
    elif installed_torch_version() is None:
        _say(
            "TORCH is empty (use the torch already installed), but this environment has no torch: install "
            f"one first ({sys.executable} -m pip install torch ...), or leave TORCH unset for the CPU build"
        )
        return 1
    else:
        source = "the environment (TORCH is empty: kept as installed)"
    info = probe()
    cpu, sentence = describe_build(info)
    size_mb = _dir_size(Path(info["path"]).parent) / 1e6
    _say(f"{sentence}; from {source}; {size_mb:.0f} MB on disk")
    if not cpu:
        _say(
            "warning: it also runs on the CPU, but with its GPU libraries it takes several GB. For the CPU "
            f"build, remove the venv and run: make install TORCH_INDEX={CPU_INDEX}"
        )
    args.constraints.parent.mkdir(parents=True, exist_ok=True)
    pinned = installed_torch_version()
    args.constraints.write_text(f"torch=={pinned}\n", encoding="utf-8")
    _say(f"pinned torch=={pinned} in {args.constraints} (pip -c) so installing gymserve cannot replace it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
