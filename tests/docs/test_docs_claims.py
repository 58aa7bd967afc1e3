"""What the docs' prose claims about the code, checked against the code itself.

Read from the code, never from a list typed here, so a new engine, route or flag without a docs entry
(or a docs entry for one that is gone) fails:

- the engine table of the local-engine page is ``gymserve.engine.ENGINES.names()``;
- every backend type of the configuration has a config example that loads with it;
- the embedded model is named as ``/v1/models`` lists it (``model_store.EMBEDDED_MODEL_NAME``), and
  requests ask for a model by the name the server lists, never by the config spelling ``embedded``;
- ``GET``/``POST`` routes named in prose exist with that method, and the HTTP API page's route table
  is exactly the app's routes;
- ``gymserve ...`` and ``make ...`` in inline code name real subcommands, flags and targets; any
  ``--flag`` in inline code is a gymserve flag, a flag of a command shown in a bash block (vLLM,
  SGLang...), one that a script in ``bench/`` or ``scripts/`` defines or passes on, or one the prose
  names as another server's ("vLLM's ``--flag``"); columns of a comparison table headed by another
  server are that server's and not checked;
- ``server.*`` / ``backend.*`` / ``sampling.*`` option paths in prose are configuration options;
- parser names in tables headed ``tool_call_parser`` are registered tool-call parsers.
"""

from __future__ import annotations

import argparse
import ast
import re
import typing

from helpers.docs_markdown import (
    ALL_BLOCKS,
    CONFIGS,
    DOCS,
    OTHER_SERVER,
    ROOT,
    blocks,
    commands_of,
    doc_files,
    inline_code,
    make_targets,
    own_prose,
    prose_of,
    server_routes,
    tables_of,
)

LOCAL_PAGE = DOCS / "model-servers" / "local.md"
HTTP_API_PAGE = DOCS / "reference" / "http-api.md"
# Pages generated from the code by scripts/gen_reference.py (checked there) and the framework's own
# routes (documented as the OpenAPI schema and its viewers, not as API routes).
GENERATED = {DOCS / "reference" / "cli.md", DOCS / "reference" / "configuration.md"}
SCHEMA_ROUTES = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def _rel(path) -> str:
    return str(path.relative_to(ROOT))


def _code(cell: str) -> str:
    return cell.strip().strip("`")


# ------------------------------------------------------------------------------------------ engines
def test_local_engine_table_is_the_engine_registry():
    from gymserve.engine import ENGINES

    [table] = [t for t in tables_of(LOCAL_PAGE) if t.heading == "## Engines"]
    documented = [_code(c) for c in table.column("`engine`")]
    assert sorted(documented) == sorted(ENGINES.names()), (
        f"{_rel(LOCAL_PAGE)} '## Engines' lists {documented}; the registry has {list(ENGINES.names())}: "
        "add a row for each engine (and its page) or remove the row of one that is gone"
    )


def test_engine_pages_quote_the_engines_install_message():
    """An engine page that says what gymserve prints without the engine's package quotes it exactly."""
    import sys

    from gymserve.engine import ENGINES

    [table] = [t for t in tables_of(LOCAL_PAGE) if t.heading == "## Engines"]
    checked = 0
    for name, page in zip(table.column("`engine`"), table.column("page")):
        link = re.search(r"\]\(([\w.-]+\.md)\)", page)
        hint = getattr(sys.modules[ENGINES.get(_code(name)).__module__], "INSTALL_HINT", None)
        if link and hint:
            text = " ".join((LOCAL_PAGE.parent / link.group(1)).read_text(encoding="utf-8").split())
            assert f"`{hint}`" in text, f"{link.group(1)} should quote the engine's message: {hint}"
            checked += 1
    assert checked, "no engine page quotes an install message"


# ----------------------------------------------------------------------------------------- backends
def _backend_config_classes() -> tuple[type, ...]:
    from gymserve.config import GymserveConfig

    return typing.get_args(GymserveConfig.model_fields["backend"].annotation)


def _backend_types() -> list[str]:
    return [typing.get_args(cls.model_fields["type"].annotation)[0] for cls in _backend_config_classes()]


def test_every_backend_type_has_a_config_example(tmp_path, monkeypatch):
    from gymserve.config import load_config

    shown = set()
    for block, env in CONFIGS:
        for name in re.findall(r"oc\.env:([A-Za-z_][A-Za-z0-9_]*)", block.code + (env or "")):
            monkeypatch.setenv(name, "placeholder-key-0123456789")
        (tmp_path / "gymserve.yaml").write_text(block.code, encoding="utf-8")
        if env is not None:
            (tmp_path / "env.yaml").write_text(env, encoding="utf-8")
        shown.add(load_config(str(tmp_path / "gymserve.yaml")).backend.type)
        (tmp_path / "env.yaml").unlink(missing_ok=True)
    missing = sorted(set(_backend_types()) - shown)
    assert not missing, f"no config example in the docs loads as backend type {missing}"
    [table] = [t for t in tables_of(DOCS / "model-servers" / "index.md") if "`type`" in t.header]
    unknown = sorted({_code(c) for c in table.column("`type`")} - set(_backend_types()))
    assert not unknown, f"model-servers/index.md names backend types the config does not have: {unknown}"


# ------------------------------------------------------------------------------------ model names
def test_the_embedded_model_is_named_as_the_server_lists_it():
    """Every spelling of the embedded model in the docs is the name ``/v1/models`` lists for it."""
    from gymserve.engine.model_store import EMBEDDED_MODEL_NAME, resolve_model

    assert resolve_model("embedded").name == EMBEDDED_MODEL_NAME  # what the local backend serves it as
    family = re.compile(r"Qwen2\.5[- ]Coder[- ]0\.5B[\w.-]*", re.I)
    bad = [
        f"{_rel(p)}: {m.group(0)!r}"
        for p in doc_files()
        for m in family.finditer(p.read_text(encoding="utf-8"))
        if m.group(0) != EMBEDDED_MODEL_NAME
    ]
    assert not bad, f"the embedded model is listed as {EMBEDDED_MODEL_NAME!r}, not: {bad}"


def _requested_models(code: str) -> list[str]:
    """Strings passed as ``model=`` in a Python snippet: literals, or names assigned a literal."""
    tree = ast.parse(code)
    consts = {
        t.id: node.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    out = []
    for node in ast.walk(tree):
        for kw in node.keywords if isinstance(node, ast.Call) else []:
            if kw.arg == "model" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                out.append(kw.value.value)
            elif kw.arg == "model" and isinstance(kw.value, ast.Name) and kw.value.id in consts:
                out.append(consts[kw.value.id])
    return out


def _configured_names(page_text: str) -> set[str]:
    """Model names a page configures a server with: ``model:``/``policy_model_name:`` values and
    ``--model``/``--served-model-name`` arguments."""
    pattern = (
        r"(?:\bmodel|policy_model_name|served_model_name):\s*\"?([\w./-]+)|--(?:served-model-name|model)\s+([\w./-]+)"
    )
    return {a or b for a, b in re.findall(pattern, page_text)}


def test_requests_ask_for_a_model_the_server_lists():
    from gymserve.engine.model_store import EMBEDDED_MODEL_NAME

    bad = []
    for b in blocks("python"):
        for name in _requested_models(b.code):
            if name == "embedded":
                bad.append(
                    f"{b.where}: model='embedded' is the config spelling; /v1/models lists {EMBEDDED_MODEL_NAME!r}"
                )
            elif not b.mark and name != EMBEDDED_MODEL_NAME and name not in _configured_names(b.path.read_text()):
                bad.append(f"{b.where}: model={name!r} is neither the embedded model nor configured on this page")
    for b in blocks("json"):
        if re.search(r'"model":\s*"embedded"', b.code):
            bad.append(f'{b.where}: "model": "embedded" in a request body')
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------------- routes
_ROUTE = re.compile(r"\b(GET|POST|PUT|PATCH|DELETE) `?(/[\w./{}-]*)")


def test_routes_named_in_the_docs_exist():
    routes = server_routes()
    bad = []
    for path in doc_files():
        for method, route in _ROUTE.findall(own_prose(path)):
            route = route.rstrip(".")
            if method not in routes.get(route, set()):
                bad.append(f"{_rel(path)}: {method} {route}")
    assert not bad, f"gymserve serves no such route: {bad}"


def test_http_api_route_table_is_the_apps_routes():
    tables = [t for t in tables_of(HTTP_API_PAGE) if t.header[0] == "route"]
    documented = {pair for t in tables for cell in t.column("route") for pair in _ROUTE.findall(cell)}
    served = {
        (m, p) for p, methods in server_routes().items() if p not in SCHEMA_ROUTES for m in methods if m != "HEAD"
    }
    assert documented == served, (
        f"{_rel(HTTP_API_PAGE)} route table: missing {sorted(served - documented)}, "
        f"not served {sorted(documented - served)}"
    )


# ------------------------------------------------------------------------------------ flags, make
def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _known_flags() -> set[str]:
    """gymserve's flags (every subcommand), flags of the commands in bash blocks, flags the
    repository's scripts define or pass to the programs they run, and flags the prose names as
    another server's ("vLLM's `--flag`")."""
    from gymserve.cli import build_parser

    parser = build_parser()
    known = _flags(parser).union(*(_flags(sub) for sub in _subparsers(parser).values()))
    for b in blocks("bash") + [blk for blk in ALL_BLOCKS if blk.mark == "skip" and blk.lang == "bash"]:
        for argv in commands_of(b.code):
            known |= {a.split("=")[0] for a in argv if a.startswith("--")}
    for script in list((ROOT / "bench").glob("*.py")) + list((ROOT / "scripts").glob("*.py")):
        # Its own options (add_argument) and those it passes to the programs it runs.
        known |= set(re.findall(r"[\"'](--[a-z][\w-]*)[\"'=]", script.read_text(encoding="utf-8")))
    for path in doc_files():  # "vLLM's `--lora-modules`": named as another server's flag
        text = " ".join(prose_of(path).split())
        known |= {m.group(2) for m in re.finditer(OTHER_SERVER.pattern + r"'s `(--[\w-]+)", text)}
    return known


def _prose_pages():
    return [p for p in doc_files() if p not in GENERATED]


def test_gymserve_and_make_commands_in_prose_exist():
    from gymserve.cli import build_parser

    parser = build_parser()
    subs = _subparsers(parser)
    bad = []
    for path in _prose_pages():
        for span in inline_code(path):
            words = span.split()
            if not words or re.search(r"[;,()']", span):  # an error message quoted in prose, not a command
                continue
            placeholder = len(words) > 1 and re.fullmatch(r"[A-Z_]+:?|<[^>]+>:?", words[1])  # `gymserve COMMAND: …`
            if words[0] == "gymserve" and len(words) > 1 and not words[1].startswith("-") and not placeholder:
                sub = subs.get(words[1])
                if sub is None:
                    bad.append(f"{_rel(path)}: `{span}`: no subcommand {words[1]!r}")
                    continue
                unknown = [
                    w for w in words[2:] if w.startswith("--") and w.split("=")[0] not in _flags(sub) | _flags(parser)
                ]
                bad += [f"{_rel(path)}: `{span}`: gymserve {words[1]} has no {w}" for w in unknown]
            elif words[0] == "make":
                bad += [
                    f"{_rel(path)}: `{span}`: no Makefile target {w!r}"
                    for w in words[1:]
                    if not w.startswith("-") and "=" not in w and w not in make_targets()
                ]
    assert not bad, "\n".join(bad)


def test_flags_in_prose_exist():
    known = _known_flags()
    bad = [
        f"{_rel(path)}: `{span}`"
        for path in _prose_pages()
        for span in inline_code(path)
        for word in span.split()[:1]
        if word.startswith("--") and word.split("=")[0] not in known
    ]
    assert not bad, f"flags no gymserve command, documented command or script has: {bad}"


# ------------------------------------------------------------------------------------------ config
def _has_option(models: tuple[type, ...], dotted: list[str]) -> bool:
    from pydantic import BaseModel

    if not dotted:
        return True
    for model in models:
        field = model.model_fields.get(dotted[0])
        if field is None:
            continue
        if len(dotted) == 1:
            return True
        inner = field.annotation
        if isinstance(inner, type) and issubclass(inner, BaseModel) and _has_option((inner,), dotted[1:]):
            return True
    return False


def test_config_option_paths_in_prose_exist():
    from gymserve.config import SamplingConfig, ServerConfig

    roots = {"server": (ServerConfig,), "backend": _backend_config_classes(), "sampling": (SamplingConfig,)}
    bad = []
    for path in _prose_pages():
        for span in inline_code(path):
            m = re.fullmatch(r"(server|backend|sampling)((?:\.\w+)+)(?::.*)?", span)
            if m and not _has_option(roots[m.group(1)], m.group(2).strip(".").split(".")):
                bad.append(f"{_rel(path)}: `{span}`")
    assert not bad, f"no such configuration option: {bad}"


def test_tool_call_parser_tables_name_registered_parsers():
    from gymserve.parsers import tool_call_parser_names

    known = set(tool_call_parser_names()) | {"auto", "none"}
    bad = []
    for path in doc_files():
        for table in tables_of(path):
            for col in [h for h in table.header if "`tool_call_parser`" in h]:
                bad += [f"{_rel(path)}: {c}" for c in table.column(col) if _code(c) not in known]
    assert not bad, f"unregistered tool-call parsers: {bad}"


def _agrees(quoted: str, actual: float) -> bool:
    """``quoted`` is ``actual`` rounded to the decimals it shows."""
    decimals = len(quoted.partition(".")[2])
    return abs(float(quoted) - actual) <= 0.5 * 10**-decimals + 1e-12


def test_streaming_latency_quoted_on_the_local_page_is_the_benchmarks():
    """The numbers local.md quotes from ``bench/ttft.py`` are those of the recorded run."""
    import json

    rows = {r["request"]: r for r in json.loads((DOCS / "assets" / "perf" / "ttft.json").read_text())["rows"]}
    text, tool = rows["text"], rows["tool call"]
    prose = " ".join(prose_of(LOCAL_PAGE).split())
    m = re.search(
        r"`response\.created` arrives after (\d+) ms \(([\d.]+) of the total\); the first text delta at ([\d.]+); "
        r"for a tool call the first argument delta at ([\d.]+)",
        prose,
    )
    assert m, "local.md no longer quotes bench/ttft.py's numbers in the sentence this test reads"
    ms, first_event, first_text, first_args = m.groups()
    assert _agrees(ms, text["first event"] * 1000) and _agrees(first_event, text["first event"] / text["total"])
    assert _agrees(first_text, text["first output"] / text["total"])
    assert _agrees(first_args, tool["first output"] / tool["total"])
