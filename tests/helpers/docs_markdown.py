"""Reading the docs for tests: fenced code blocks (with their ``<!-- test: MARK -->``), the shell
commands in them, prose with its inline code, tables, and generated samples.

The conventions the blocks follow are described in ``tests/docs/test_docs.py``; ``test_docs_claims.py``
and ``test_docs_samples.py`` use the same readers.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    code: str
    mark: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    return sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]


_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<info>.*)$")
_MARK = re.compile(r"<!--\s*test:\s*(?P<mark>.*?)\s*-->")


def blocks_of(path: Path) -> list[Block]:
    """Fenced code blocks of one Markdown file, with the test mark just above each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group("indent"), m.group("fence"), m.group("info").strip()
        start = i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.search(prev)
        lang = info.split()[0].lstrip(".{").rstrip("}") if info else ""
        out.append(Block(path, start + 1, lang, "\n".join(body) + "\n", mark.group("mark") if mark else ""))
    return out


ALL_BLOCKS = [b for p in doc_files() for b in blocks_of(p)]


def blocks(lang: str) -> list[Block]:
    return [b for b in ALL_BLOCKS if b.lang == lang and b.mark != "skip"]


def ids(bs: list[Block]) -> list[str]:
    return [b.where for b in bs]


def commands_of(code: str) -> list[list[str]]:
    """Command argv lists of a bash block: comments dropped, continuations joined, ``&&`` split."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        argv = shlex.split(line, comments=True)
        cmd: list[str] = []
        for tok in argv + ["&&"]:
            if tok in ("&&", "||", ";"):
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(tok)
    return out


def env_assignments(argv: list[str]) -> list[str]:
    """``A=1 B=2 cmd ...`` → ``cmd ...``."""
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
        argv = argv[1:]
    return argv


def config_blocks() -> list[tuple[Block, str | None]]:
    """(config block, text of the page's latest env.yaml block before it)."""
    out, env = [], {}
    for b in blocks("yaml"):
        if b.code.lstrip().startswith("# env.yaml"):
            env[b.path] = b.code
        else:
            out.append((b, env.get(b.path)))
    return out


CONFIGS = config_blocks()


def prose_of(path: Path) -> str:
    """The page without its fenced code blocks (each replaced by one blank line) and HTML comments."""
    text = path.read_text(encoding="utf-8")
    out, fence = [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group("fence")
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
        else:
            out.append(line)
    return re.sub(r"<!--.*?-->", "", "\n".join(out), flags=re.S)


# A table column headed by one of these (and not by gymserve) quotes that server: its flags and
# routes are the other server's, as in a comparison table.
OTHER_SERVER = re.compile(r"\b(vLLM|SGLang|TensorRT-LLM|trtllm-serve|llama\.cpp|llama-server|Ray Serve)\b")


def _split_row(line: str) -> list[str]:
    """The cells of a table row: split at pipes that are neither escaped nor inside inline code."""
    cells, cell, in_code, prev = [], "", False, ""
    for ch in line.strip()[1:].removesuffix("|"):
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code and prev != "\\":
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
        prev = ch
    return [*cells, cell.strip()]


def own_prose(path: Path) -> str:
    """The prose that speaks for gymserve: ``prose_of(path)`` without the table columns whose header
    names another server and not gymserve."""
    out, keep = [], None
    for line in prose_of(path).splitlines():
        if not line.startswith("|"):
            out.append(line)
            keep = None
            continue
        cells = _split_row(line)
        if keep is None:  # the header row
            keep = [not OTHER_SERVER.search(c) or "gymserve" in c for c in cells]
        out.append(" | ".join(c for c, k in zip(cells, keep) if k))
    return "\n".join(out)


def inline_code(path: Path) -> list[str]:
    """The inline code spans (`` `...` ``) of ``own_prose(path)``, a span broken over lines joined by a space."""
    return [" ".join(span.split()) for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", own_prose(path))]


@dataclass
class Table:
    """A Markdown table: the nearest heading above it, its header cells and its rows (cells stripped)."""

    heading: str
    header: list[str]
    rows: list[list[str]]

    def column(self, name: str) -> list[str]:
        return [row[self.header.index(name)] for row in self.rows]


def tables_of(path: Path) -> list[Table]:
    """Every table of a page's prose."""
    out: list[Table] = []
    heading, current = "", None
    for line in prose_of(path).splitlines() + [""]:
        if line.startswith("|"):
            cells = _split_row(line)
            if current is None:
                current = [cells]
            else:
                current.append(cells)
            continue
        if current is not None:
            out.append(Table(heading, current[0], current[2:]))
            current = None
        if line.startswith("#"):
            heading = line
    return out


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z0-9_.-]+):", text, re.M))


def server_routes() -> dict[str, set[str]]:
    """``{path: methods}`` of the app gymserve serves (any backend: the routes do not depend on it)."""
    from gymserve.backends.base import Backend
    from gymserve.server.app import create_app

    class Unused(Backend):  # routes only: no call reaches it
        from_config = chat = chat_stream = models = describe = None

    routes: dict[str, set[str]] = {}
    for r in create_app(Unused()).routes:
        routes.setdefault(r.path, set()).update(getattr(r, "methods", None) or ())
    return routes
