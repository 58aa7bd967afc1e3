"""Fail on an upward import: the layering of ``src/gymserve`` as a check (run by ``make lint``).

The data path reads top to bottom — protocol → convert/parsers → engine/backends → server → cli — and
arrows point one way: a module may import only modules of its own layer or a lower one. Every import
counts, the lazy ones inside functions too (they are still dependencies, only deferred). ``LAYERS`` maps
a module prefix to its layer (the longest matching prefix wins); a module that no prefix covers is an
error too, so a new package must be placed on purpose.

The registries have one home, ``gymserve.registry`` (layer 0, naming implementations of higher layers
by string so it imports nothing above it): every ``"module:Attr"`` entry there must name a module of
the tree that some layer covers, and no other module may build a ``Registry`` (a second home).

Usage: ``python scripts/check_layers.py [SRC_DIR]`` (default ``src``); exit status 1 with one line per
upward import, 0 when the layering holds.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# (prefix, layer): higher layers may import lower ones, never the reverse.
LAYERS: dict[str, int] = {
    # 0 — vocabulary every layer shares: no gymserve imports above it.
    "gymserve.errors": 0,
    "gymserve.text": 0,
    "gymserve.redaction": 0,
    "gymserve.wire": 0,
    "gymserve.registry": 0,
    "gymserve.protocol": 0,
    "gymserve.control": 0,  # the control verbs and their vocabulary; implemented at layers 2 (engines) and 4
    "gymserve._version": 0,
    # 1 — pure conversion and parsing (no I/O).
    "gymserve.convert": 1,
    "gymserve.parsers": 1,
    # 2 — chat templates, the prefix splice, engines and the model store.
    "gymserve.prompting": 2,
    "gymserve.engine": 2,
    # 3 — configuration (validated settings; names come from the registries below it).
    "gymserve.config": 3,
    # 4 — backends, Ray replicas included.
    "gymserve.backends": 4,
    "gymserve.ray_cluster": 4,
    # 5 — the HTTP server and what runs one.
    "gymserve.server": 5,
    "gymserve.check": 5,
    "gymserve.failures": 5,  # how a failure is reported (names server.run's BindError); harness and cli use it
    # 6 — the RL harness: agents, environments, rollouts, verification, the demo (clients of the server).
    "gymserve.harness": 6,
    "gymserve.trainer": 6,  # the trainer's weight-sync client (a client of the server, as the harness)
    # 7 — command line and the package's public face.
    "gymserve.cli": 7,
    "gymserve.ray_cluster.cli": 7,
    "gymserve.__main__": 7,  # python -m gymserve: the cli
}
PACKAGE = "gymserve"  # its __init__ states the public API: it may import any layer (layer 7)


def layer_of(module: str) -> tuple[str, int] | None:
    """``(prefix, layer)`` for ``module`` by the longest prefix in ``LAYERS``; None when uncovered."""
    if module == PACKAGE:
        return (PACKAGE, 7)
    best = None
    for prefix, layer in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, layer)
    return best


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every gymserve import in ``path``, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "gymserve"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] == "gymserve":
                # ``from gymserve.x import y`` may name a submodule y: judge the longer name when it exists.
                found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return found


def check(src: Path) -> list[str]:
    """Every violation as ``file:line: message``."""
    problems = []
    modules = {module_name(path, src): path for path in sorted((src / PACKAGE).rglob("*.py"))}
    for prefix in LAYERS:
        if not any(m == prefix or m.startswith(prefix + ".") for m in modules):
            problems.append(f"{__file__}:1: layer entry {prefix!r} names no module any more; remove it")
    for module, path in modules.items():
        own = layer_of(module)
        where = path.relative_to(src.parent) if src.parent in path.parents else path
        if own is None:
            problems.append(f"{where}:1: {module} is in no layer; add its package to LAYERS in {__file__}")
            continue
        for line, target in imports_of(path, module):
            theirs = layer_of(target) or layer_of(target.rpartition(".")[0])
            if theirs is not None and theirs[1] > own[1]:
                problems.append(
                    f"{where}:{line}: {module} (layer {own[1]}, {own[0]}) imports {target} "
                    f"(layer {theirs[1]}, {theirs[0]}): an upward import"
                )
    return problems


REGISTRY = "gymserve.registry"


def check_registry(modules: dict[str, Path], src: Path) -> list[str]:
    """The registry rules of the module docstring, as ``file:line: message`` lines."""
    problems = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(src.parent) if src.parent in path.parents else path
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name == "Registry" and module != REGISTRY:
                problems.append(
                    f"{where}:{node.lineno}: {module} builds a Registry; registries live in {REGISTRY} only"
                )
            target = node.args[1] if len(node.args) > 1 else None
            if module == REGISTRY and name == "register" and isinstance(target, ast.Constant):
                entry = str(target.value).partition(":")[0]
                if entry not in modules:
                    problems.append(
                        f"{where}:{node.lineno}: registry entry {target.value!r} names no module of the tree"
                    )
                elif layer_of(entry) is None:
                    problems.append(
                        f"{where}:{node.lineno}: registry entry {target.value!r} names a module in no layer"
                    )
    return problems


def main(argv: list[str]) -> int:
    src = Path(argv[1]) if len(argv) > 1 else Path("src")
    problems = check(src)
    modules = {module_name(path, src): path for path in sorted((src / PACKAGE).rglob("*.py"))}
    problems += check_registry(modules, src)
    for line in problems:
        print(line)
    if problems:
        print(f"check_layers: {len(problems)} upward import(s); see the layer table at the top of {__file__}")
        return 1
    print("check_layers: layering holds")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
