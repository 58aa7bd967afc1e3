"""The documentation is tested against the code: every code block runs, parses or validates.

Conventions (what the docs may contain, and what this file does with it):

- Every fenced code block in ``docs/**/*.md`` and ``README.md`` names its language, one of
  ``bash``, ``python``, ``yaml``, ``json``, ``text``. ``text`` blocks (program output, diagrams)
  are not checked.
- A block may be preceded by an HTML comment ``<!-- test: MARK -->`` that changes what happens:
  ``skip`` (not checked), ``compile`` (python: compiled only), ``openai`` / ``azure`` (python: run
  against the fake OpenAI / Azure OpenAI server of ``tests/helpers/fakes.py``), ``azure-config`` (yaml:
  also served through the Azure backend against the fake), ``example NAME ROLE`` (json: one part
  of a worked conversion example, see ``test_worked_examples``).
- ``bash``: each command (backslash continuations joined, ``&&`` splits) is checked by its first
  word. ``gymserve ... --help`` runs for real (exit 0). Every other ``gymserve`` command line —
  ``serve``, ``demo``, ``rollout`` need a model, a server or a cloud — must parse with
  ``gymserve.cli.build_parser()``: a renamed flag fails here, not for the reader. ``make T``: T
  must be a Makefile target. ``curl`` to ``127.0.0.1:8000`` must name a route the server has.
  ``vllm``, ``python -m sglang...``, ``trtllm-serve``, ``llama-server``, ``transformers serve``,
  ``pip``, ``export``, ``cd``, ``cat``, ``python`` are documented, not run (no vLLM or GPU here):
  shell syntax only (``bash -n``). Any other command is an error, so new kinds get a rule here.
- ``yaml``: a block whose first line is ``# env.yaml`` is an env file: it is written beside every
  later config block of the same page. Every other yaml block is a gymserve config and must load
  with ``gymserve.config.load_config``; ``${oc.env:NAME}`` variables are set to placeholders.
- ``json``: must parse (whole block, or one JSON value per line).
- ``python``: runs for real, in-process, against a gymserve server started by this file over the
  tiny random-weight model (``tiny_model_dir``); ``http://127.0.0.1:8000/v1`` in the snippet is
  rewritten to that server's URL (and ``http://127.0.0.1:8000``, the anthropic SDK's base URL, to
  its root). ``azure``/``openai`` snippets get the fake's URL instead of
  ``https://RESOURCE.openai.azure.com`` / ``https://api.openai.com/v1`` and its key in
  ``AZURE_OPENAI_API_KEY`` / ``OPENAI_API_KEY``.

Also: ``mkdocs build --strict`` succeeds; the generated reference pages are up to date; the README's
quick start is the block the site includes; every backend error message is in the errors reference.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import json
import re
import subprocess
import sys
from urllib.parse import urlsplit

import pytest

from helpers.docs_markdown import (
    ALL_BLOCKS,
    CONFIGS,
    DOCS,
    ROOT,
    Block,
    blocks,
    blocks_of,
    commands_of,
    env_assignments,
    ids,
    make_targets,
    server_routes,
)

LANGUAGES = {"bash", "python", "yaml", "json", "text"}
LOCAL_URL = "http://127.0.0.1:8000/v1"
LOCAL_ROOT = "http://127.0.0.1:8000"  # the anthropic SDK's base URL: it appends /v1/messages itself
AZURE_URL = "https://RESOURCE.openai.azure.com"
OPENAI_URL = "https://api.openai.com/v1"
FAKE_KEY = "docs-test-key-0123456789"
AZURE_VERSION = "2025-04-01-preview"
AZURE_DEPLOYMENT = "my-gpt-4o"
DOC_COMMANDS_NOT_RUN = {
    "vllm",
    "trtllm-serve",
    "llama-server",
    "transformers",
    "pip",
    "export",
    "cd",
    "cat",
    "python",
    "python3",
    "source",
    ".",
}


# ---------------------------------------------------------------------------------------- general
def test_docs_exist_and_every_block_has_a_language():
    assert (DOCS / "index.md").exists() and len(ALL_BLOCKS) > 20
    bad = [f"{b.where} ({b.lang or 'no language'})" for b in ALL_BLOCKS if b.lang not in LANGUAGES]
    assert not bad, f"code blocks need one of {sorted(LANGUAGES)}: {bad}"


def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The README's quick start reached the site through the snippet include (one source).
    html = (tmp_path / "site" / "getting-started" / "index.html").read_text(encoding="utf-8")
    page = re.sub(r"<[^>]+>", "", html)  # code is highlighted token by token
    assert "make demo" in page and "make test" in page and "--8&lt;--" not in page


def test_readme_quick_start_is_the_site_quick_start():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start, end = "<!-- --8<-- [start:quickstart] -->", "<!-- --8<-- [end:quickstart] -->"
    assert readme.count(start) == 1 and readme.count(end) == 1
    section = readme.split(start)[1].split(end)[0]
    commands = [b.code.strip() for b in blocks_of(ROOT / "README.md") if b.lang == "bash" and b.code.strip() in section]
    assert commands == ["make demo", "make test"], "the quick start is exactly two commands: make demo, make test"
    assert '--8<-- "README.md:quickstart"' in (DOCS / "getting-started.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "make test" in ci, ".ci/run must call the README's test command"


def test_generated_reference_is_up_to_date():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_reference
    finally:
        sys.path.pop(0)
    for path, build in gen_reference.PAGES.items():
        assert path.exists(), f"{path} missing: run python scripts/gen_reference.py"
        assert path.read_text(encoding="utf-8") == build(), (
            f"{path.relative_to(ROOT)} is out of date: run python scripts/gen_reference.py"
        )


# ------------------------------------------------------------------------------------------- bash


@pytest.mark.parametrize("block", blocks("bash"), ids=ids(blocks("bash")))
def test_bash_block(block):
    from gymserve.cli import build_parser

    syntax = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
    assert syntax.returncode == 0, f"{block.where}: {syntax.stderr}"
    for argv in commands_of(block.code):
        argv = env_assignments(argv)
        word = argv[0]
        if word == "gymserve":
            if "--help" in argv or "-h" in argv:
                proc = subprocess.run(
                    [sys.executable, "-m", "gymserve.cli", *argv[1:]],
                    capture_output=True,
                    text=True,
                    timeout=120,
                    cwd=ROOT,
                )
                assert proc.returncode == 0, f"{block.where}: {' '.join(argv)}\n{proc.stderr}"
                assert "usage: gymserve" in proc.stdout
                continue
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    build_parser().parse_args(argv[1:])
                except SystemExit as exc:
                    pytest.fail(f"{block.where}: `{' '.join(argv)}` does not parse (exit {exc.code}): {err.getvalue()}")
        elif word == "make":
            missing = [t for t in argv[1:] if not t.startswith("-") and "=" not in t and t not in make_targets()]
            assert not missing, f"{block.where}: no Makefile target {missing}"
        elif word == "curl":
            urls = [a for a in argv if a.startswith("http")]
            assert urls, f"{block.where}: curl without a URL"
            for url in urls:
                parts = urlsplit(url)
                if parts.port == 8000:
                    assert parts.path in server_routes(), f"{block.where}: gymserve has no route {parts.path}"
        else:
            assert word in DOC_COMMANDS_NOT_RUN, (
                f"{block.where}: no test rule for command {word!r}; add one in tests/docs/test_docs.py"
            )


# ------------------------------------------------------------------------------------------- yaml
@pytest.mark.parametrize("block, env", CONFIGS, ids=[b.where for b, _ in CONFIGS])
def test_yaml_config_block_loads(block, env, tmp_path, monkeypatch):
    from gymserve.config import load_config

    for name in re.findall(r"oc\.env:([A-Za-z_][A-Za-z0-9_]*)", block.code + (env or "")):
        monkeypatch.setenv(name, FAKE_KEY)
    path = tmp_path / "gymserve.yaml"
    path.write_text(block.code, encoding="utf-8")
    if env is not None:
        (tmp_path / "env.yaml").write_text(env, encoding="utf-8")
    try:
        config = load_config(str(path))
    except ValueError as exc:
        pytest.fail(f"{block.where}: {exc}")
    if block.mark == "azure-config":
        _serve_through_fake_azure(block, config)


def _serve_through_fake_azure(block: Block, config) -> None:
    """The Azure config, pointed at the fake Azure resource, answers the API it is configured for."""
    from gymserve.backends import build_backend
    from gymserve.backends.base import RequestContext
    from helpers.fakes import FakeServer, azure_handler

    b = config.backend
    assert b.type == "azure" and b.api_version == AZURE_VERSION and b.deployment_name == AZURE_DEPLOYMENT, block.where
    handler = azure_handler(api_key=FAKE_KEY, api_version=AZURE_VERSION, deployment=AZURE_DEPLOYMENT)
    with FakeServer(handler) as fake:
        assert b.endpoint is not None and b.endpoint.startswith(AZURE_URL), block.where
        local = config.model_copy(
            update={"backend": b.model_copy(update={"endpoint": b.endpoint.replace(AZURE_URL, fake.url)})}
        )

        async def go():
            backend = build_backend(local)
            try:
                return await backend.responses({"model": "policy", "input": "hi"}, RequestContext())
            finally:
                await backend.close()

        response = asyncio.run(go())
    text = response["output"][-1]["content"][0]["text"]
    assert text == f"hello from azure {b.api}", f"{block.where}: {text}"


# ------------------------------------------------------------------------------------------- json
@pytest.mark.parametrize("block", blocks("json"), ids=ids(blocks("json")))
def test_json_block_parses(block):
    try:
        json.loads(block.code)
    except ValueError:
        for n, line in enumerate(block.code.splitlines()):
            if line.strip():
                try:
                    json.loads(line)
                except ValueError as exc:
                    pytest.fail(f"{block.where}+{n + 1}: {exc}")


def _examples() -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for b in blocks("json"):
        parts = b.mark.split()
        if parts[:1] == ["example"]:
            out.setdefault(parts[1], {})[parts[2]] = json.loads(b.code)
    return out


def _strip_ids(items):
    return [{k: v for k, v in it.items() if k != "id"} for it in items]


@pytest.mark.parametrize("name", sorted(_examples()))
def test_worked_examples(name):
    """A worked example shows what the converter really does: Responses request → chat request,
    and chat completion → Response output items (item ids aside, they are random)."""
    from gymserve.convert import chat_to_response, responses_to_chat

    ex = _examples()[name]
    request = ex["responses-request"]
    if "chat-request" in ex:
        assert responses_to_chat(request) == ex["chat-request"]
    if "chat-completion" in ex:
        from gymserve.backends.chat_wire import mirror_reasoning

        completion = json.loads(json.dumps(ex["chat-completion"]))
        mirror_reasoning(completion["choices"][0]["message"])  # what the chat backend does first
        got = chat_to_response(completion, request)
        assert _strip_ids(got["output"]) == _strip_ids(ex["response-output"])


# ----------------------------------------------------------------------------------------- python
@pytest.fixture(scope="module")
def docs_server(tiny_model_dir, tmp_path_factory):
    """The local backend on the tiny model, served under the embedded model's name (a directory's
    name is the served name), so snippets ask for the model by the name a reader's server lists."""
    from gymserve.backends.local import LocalBackend
    from gymserve.config import GymserveConfig, LocalBackendConfig, ServerConfig
    from gymserve.engine.model_store import EMBEDDED_MODEL_NAME
    from gymserve.server.run import start_background_server

    model_dir = tmp_path_factory.mktemp("docs-model") / EMBEDDED_MODEL_NAME
    model_dir.symlink_to(tiny_model_dir, target_is_directory=True)
    cfg = GymserveConfig(
        server=ServerConfig(port=0), backend=LocalBackendConfig(model=str(model_dir), max_model_len=2048)
    )
    srv = start_background_server(cfg, backend_factory=lambda: LocalBackend.from_config(cfg.backend))
    yield srv
    srv.stop()


def _run_snippet(block: Block, code: str, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            exec(compile(code, block.where, "exec"), {"__name__": "__main__"})
        except SystemExit as exc:
            assert exc.code in (0, None), f"{block.where}: exit {exc.code}"


PY = blocks("python")


@pytest.mark.parametrize("block", PY, ids=ids(PY))
def test_python_block(block, request, monkeypatch):
    code = block.code
    compile(code, block.where, "exec")
    if block.mark == "compile":
        return
    if block.mark == "azure":
        from helpers.fakes import FakeServer, azure_handler

        monkeypatch.setenv("AZURE_OPENAI_API_KEY", FAKE_KEY)
        handler = azure_handler(api_key=FAKE_KEY, api_version=AZURE_VERSION, deployment=AZURE_DEPLOYMENT)
        with FakeServer(handler) as fake:
            assert AZURE_URL in code, block.where
            _run_snippet(block, code.replace(AZURE_URL, fake.url), monkeypatch)
        return
    if block.mark == "openai":
        from helpers.fakes import FakeServer, openai_handler

        monkeypatch.setenv("OPENAI_API_KEY", FAKE_KEY)
        with FakeServer(openai_handler(FAKE_KEY, model="gpt-4.1-mini")) as fake:
            assert OPENAI_URL in code, block.where
            _run_snippet(block, code.replace(OPENAI_URL, fake.url + "/v1"), monkeypatch)
        return
    assert not block.mark, f"{block.where}: unknown test mark {block.mark!r}"
    server = request.getfixturevalue("docs_server")
    code = code.replace(LOCAL_URL, server.base_url).replace(LOCAL_ROOT, server.base_url.removesuffix("/v1"))
    _run_snippet(block, code, monkeypatch)


def _get(server, path: str):
    import httpx

    return httpx.get(server.base_url.removesuffix("/v1") + path, timeout=30)


def test_local_health_answer_is_as_documented(docs_server):
    """The keys local.md shows for the local backend's ``/health`` are in the real answer."""
    page = (DOCS / "model-servers" / "local.md").read_text(encoding="utf-8")
    [shown] = re.findall(r"`/health` answers `(\{.*?\})`", page, re.S)
    health = _get(docs_server, "/health").json()
    missing = [k for k in re.findall(r'"(\w+)":', shown) if k not in health]
    assert not missing, f"local.md shows /health keys the answer lacks: {missing} (answer: {sorted(health)})"
    assert (health["status"], health["backend"]) == ("ok", "local")


def test_metric_names_in_the_docs_are_exposed(docs_server):
    text = _get(docs_server, "/metrics").text
    exposed = set(re.findall(r"^# TYPE (\S+)", text, re.M))
    exposed |= {f"{n}{s}" for n in exposed for s in ("_bucket", "_count", "_sum")}
    documented = {
        name for p in DOCS.rglob("*.md") for name in re.findall(r"`(gymserve_\w+)`", p.read_text(encoding="utf-8"))
    }
    assert documented and documented <= exposed, f"not exposed by /metrics: {sorted(documented - exposed)}"


# ----------------------------------------------------------------------------------------- errors
ERROR_MODULES = (
    "errors.py",
    "config.py",
    "backends/__init__.py",
    "backends/upstream_errors.py",
    "backends/chat.py",
    "backends/remote.py",
    "backends/caller.py",
    "backends/upstream.py",
    "backends/chat_wire.py",
    "backends/token_stream.py",
    "backends/azure.py",
    "backends/pool.py",
    "backends/openai_backend.py",
    "backends/anthropic.py",
    "backends/local/request.py",
    "backends/local/completions.py",
    "backends/completion_tokens.py",
    "backends/remote_completions.py",
    "backends/remote_tokens.py",
    "convert/completions_request.py",
    "convert/tokenize_request.py",
    "prompting/splice.py",
    "prompting/prefix.py",
    "engine/model_cache.py",
    "engine/model_store.py",
    "server/app.py",
    "server/auth.py",
    "server/errors.py",
    "convert/request_checks.py",
    "engine/weights.py",
    "engine/control.py",
    "engine/base.py",
    "backends/base.py",
    "control.py",
    "server/control_routes.py",
    "engine/lora.py",
    "backends/local/backend.py",
    "engine/pause_gate.py",
    "engine/library_control.py",
    "engine/vllm_engine.py",
    "engine/trtllm_engine.py",
    "backends/chat_control.py",
    "backends/upstream_control.py",
    "ray_cluster/control.py",
    "ray_cluster/replica_control.py",
    "engine/gguf_store.py",
    "engine/gguf_lora.py",
    "engine/llamacpp_runtime.py",
    "engine/llamacpp_engine.py",
    "engine/llamacpp_lora.py",
)
HINT_FUNCTIONS = ("_not_found_hint", "_connection_hint")


def _fragments(node: ast.AST) -> list[str]:
    """The literal pieces of a string or f-string expression (concatenations included)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _fragments(node.left) + _fragments(node.right)
    return []


def backend_error_fragments() -> dict[str, str]:
    """{longest literal piece of each error message: where} for the backend error modules."""
    found: dict[str, str] = {}

    def add(parts: list[str], where: str) -> None:
        best = max((p.strip(" .;:,'\"(") for p in parts), key=len, default="")
        if len(best) >= 12:
            found[best] = where

    for rel in ERROR_MODULES:
        path = ROOT / "src" / "gymserve" / rel
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and len(node.args) > (
                1 if getattr(node.func, "id", "") == "error_response" else 0
            ):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", "")
                if (name.endswith("Error") and name != "TypeError") or name in ("__init__", "error_response"):
                    arg = node.args[1] if name == "error_response" else node.args[0]
                    add(_fragments(arg), f"{rel}:{node.lineno}")
            if isinstance(node, ast.FunctionDef) and node.name in HINT_FUNCTIONS:
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Return, ast.Assign)) and sub.value is not None:
                        add(_fragments(sub.value), f"{rel}:{sub.lineno}")
    return found


def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("\\|", "|").replace("`", ""))


def test_errors_reference_lists_every_backend_error_message():
    page = _normalize((DOCS / "reference" / "errors.md").read_text(encoding="utf-8"))
    missing = [
        f"{where}: {frag!r}" for frag, where in backend_error_fragments().items() if _normalize(frag) not in page
    ]
    assert not missing, "docs/reference/errors.md lacks these messages:\n" + "\n".join(missing)


def test_docs_mention_no_unknown_parser_names():
    """Parser names the docs give to gymserve (flags of gymserve commands, config options) exist."""
    from gymserve.parsers import reasoning_parser_names, tool_call_parser_names

    known = set(tool_call_parser_names()) | set(reasoning_parser_names()) | {"auto", "none"}
    used = []
    for b in blocks("bash"):
        for argv in commands_of(b.code):
            argv = env_assignments(argv)
            if argv[0] == "gymserve":
                used += [
                    (b, argv[i + 1])
                    for i, a in enumerate(argv[:-1])
                    if a in ("--tool-call-parser", "--reasoning-parser")
                ]
    for b, _ in CONFIGS:
        used += [(b, name) for name in re.findall(r"^\s*(?:tool_call_parser|reasoning_parser):\s*(\S+)", b.code, re.M)]
    bad = [f"{b.where}: {name}" for b, name in used if name.strip("'\"") not in known]
    assert not bad, f"unknown parser names: {bad}"
