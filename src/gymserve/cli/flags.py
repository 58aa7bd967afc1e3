"""The flags of ``gymserve serve``, ``check`` and ``launch``, each tied to the config key it sets.

Every flag is one ``Flag``: its option strings, the dotted config key it overrides (the YAML from
``--config`` is read first, flags win), the backend types it applies to, and its argparse options.
Names follow ``vllm serve`` where the concept is the same (``MODEL`` positional,
``--served-model-name``, ``--max-model-len``, ``--max-num-seqs``, ``--seed``, ``--api-key``,
``--tool-call-parser``, ``--reasoning-parser``, ``--chat-template``, ``--tensor-parallel-size``,
``--gpu-memory-utilization``, ``--dtype``, ``--enforce-eager``); the rest spell the config key (``--temperature`` is
``backend.sampling.temperature``). A flag given for a backend it does not apply to is a
``FlagError`` naming the flag, the backend and what to do, never a silently ignored value.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gymserve.config import ConfigError
from gymserve.parsers import reasoning_parser_names, tool_call_parser_names
from gymserve.registry import BACKENDS, ENGINES

LOCAL = frozenset({"local", "ray"})
REMOTE = frozenset({"chat", "openai", "azure", "anthropic"})
PARSING = LOCAL | {"chat"}
GPU_ENGINES = frozenset({"vllm", "trtllm"})
BACKEND_TYPES = BACKENDS.names()


class FlagError(ConfigError):
    """A command-line flag cannot be used as given; the message names the flag and the fix."""


def context_length(text: str) -> int:
    """``--max-model-len`` values: ``4096``, or ``32k`` (x1000) / ``32K`` (x1024) as ``vllm serve``
    reads them. Raises ``argparse.ArgumentTypeError``."""
    match = re.fullmatch(r"\s*(\d+)([kK]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a token count such as 4096, 32k or 32K, got {text!r}")
    number, suffix = int(match.group(1)), match.group(2)
    return number * {"": 1, "k": 1000, "K": 1024}[suffix]


def from_env(flag: str) -> Callable[[str, str | None], str]:
    """A converter reading the environment variable a ``--*-env`` flag names; ``FlagError`` if unset."""

    def read(name: str, kind: str | None) -> str:
        value = os.environ.get(name)
        if not value:
            raise FlagError(
                f"{flag} {name}: that environment variable is not set (or empty); export it, or name another one"
            )
        return value

    return read


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: each flag is one object
class Flag:
    """One flag. ``key``: the dotted config key, or ``{backend type: key}`` where it differs by type.
    ``kinds``: backend types it applies to (None: every one). ``engines``: local engines it applies
    to (None: every one). ``convert(value, kind)``: the config value (``kind`` None when the backend
    type is not known yet). ``options``: ``add_argument`` keyword arguments."""

    names: tuple[str, ...]
    key: str | Mapping[str, str]
    options: dict[str, Any] = field(default_factory=dict)
    kinds: frozenset[str] | None = None
    engines: frozenset[str] | None = None
    convert: Callable[..., Any] | None = None

    @property
    def dest(self) -> str:
        return self.options.get("dest") or self.names[0].lstrip("-").replace("-", "_")

    def key_for(self, kind: str) -> str:
        return self.key if isinstance(self.key, str) else self.key[kind]

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        keys = self.key if isinstance(self.key, str) else ", ".join(dict.fromkeys(self.key.values()))
        help_text = self.options.get("help", "")
        parser.add_argument(*self.names, **{**self.options, "help": f"{help_text} [config: {keys}]"})


def _one_url(urls: list[str], kind: str) -> str:
    if len(urls) > 1:
        raise FlagError(
            f"--base-url given {len(urls)} times: only the chat backend has replicas; the {kind} backend takes one URL"
        )
    return urls[0]


MODEL = Flag(("--model",), "backend.model", {"help": "the same as the positional MODEL (kept for older command lines)"})
SERVED_MODEL_NAME = Flag(
    ("--served-model-name",),
    "backend.served_model_name",
    {
        "nargs": "+",
        "metavar": "NAME",
        "help": "name(s) clients use for the model, as in vllm serve: the first is what answers report in "
        "`model` and what /v1/models lists first; the others are listed after it as aliases "
        "(default: the model's own name)",
    },
)

UPSTREAM = (
    Flag(
        ("--backend",),
        "backend.type",
        {"choices": BACKEND_TYPES, "help": "where the model runs (default: local, or chat when --base-url is given)"},
    ),
    Flag(
        ("--base-url",),
        {
            "chat": "backend.base_urls",
            "openai": "backend.base_url",
            "azure": "backend.endpoint",
            "anthropic": "backend.base_url",
        },
        {
            "action": "append",
            "metavar": "URL",
            "help": "upstream base URL ending in /v1 (implies --backend chat); repeat for replicas; azure: the "
            "resource endpoint; anthropic: the server root (https://api.anthropic.com)",
        },
        kinds=REMOTE,
        convert=lambda urls, kind: _one_url(urls, kind) if kind in ("openai", "azure", "anthropic") else urls,
    ),
    Flag(
        ("--api-version",),
        "backend.api_version",
        {"help": "azure: the api-version query parameter sent on every request"},
        kinds=frozenset({"azure"}),
    ),
    Flag(
        ("--api-key-env",),
        "backend.api_key",
        {
            "metavar": "NAME",
            "help": "environment variable holding the UPSTREAM API key (for the key clients of "
            "this server present, see --api-key)",
        },
        kinds=REMOTE,
        convert=from_env("--api-key-env"),
    ),
    Flag(
        ("--return-token-id-information",),
        "backend.return_token_id_information",
        {
            "action": argparse.BooleanOptionalAction,
            "default": None,
            "help": "ask the chat server for prompt/generation token IDs and log-probs (vLLM >= 0.10.2) and return "
            "them as training fields; the local backend always returns them",
        },
        kinds=frozenset({"chat"}),
    ),
    Flag(
        ("--tokenizer",),
        "backend.tokenizer",
        {
            "metavar": "DIR",
            "help": "the served model's Hugging Face tokenizer directory (vLLM's --tokenizer): /tokenize and "
            "/detokenize are answered from it instead of forwarded to the chat server",
        },
        kinds=frozenset({"chat"}),
    ),
)

ENGINE = (
    Flag(
        ("--engine",),
        "backend.engine",
        {
            "choices": ENGINES.names(),
            "help": "local inference engine: transformers (CPU, the default), llamacpp (CPU, GGUF weights), "
            "vllm or trtllm (GPU)",
        },
        kinds=LOCAL,
    ),
    Flag(
        ("--max-model-len",),
        "backend.max_model_len",
        {
            "type": context_length,
            "metavar": "TOKENS",
            "help": "the context window: prompt + generation tokens per request, as in vllm serve (4096, 32k, 32K; "
            "default: the model's)",
        },
        kinds=LOCAL,
    ),
    Flag(
        ("--max-num-seqs",),
        "backend.max_num_seqs",
        {"type": int, "metavar": "N", "help": "sequences decoded together, as in vllm serve; more requests wait"},
        kinds=LOCAL,
    ),
    Flag(
        ("--chat-template",),
        "backend.chat_template",
        {"metavar": "FILE", "help": "Jinja chat template file overriding the tokenizer's, or harmony (gpt-oss)"},
        kinds=LOCAL,
    ),
    Flag(
        ("--tensor-parallel-size", "-tp"),
        "backend.engine_args.tensor_parallel_size",
        {"type": int, "metavar": "N", "help": "GPUs per replica, as in vllm serve (vllm, trtllm engines)"},
        kinds=LOCAL,
        engines=GPU_ENGINES,
    ),
    Flag(
        ("--gpu-memory-utilization",),
        "backend.engine_args.gpu_memory_utilization",
        {
            "type": float,
            "metavar": "FRACTION",
            "help": "share of GPU memory the engine may use, as in vllm serve (vllm, trtllm engines)",
        },
        kinds=LOCAL,
        engines=GPU_ENGINES,
    ),
    Flag(
        ("--dtype",),
        "backend.engine_args.dtype",
        {
            "choices": ("auto", "float32", "float16", "bfloat16", "half", "float"),
            "help": "the weights' and activations' dtype, as in vllm serve (vllm engine; auto: the checkpoint's, "
            "float32 for exact log-probs on a CPU)",
        },
        kinds=LOCAL,
        engines=frozenset({"vllm"}),
    ),
    Flag(
        ("--enforce-eager",),
        "backend.engine_args.enforce_eager",
        {
            "action": "store_const",
            "const": True,
            "help": "no CUDA graphs or torch.compile, as in vllm serve (vllm engine; starts faster, decodes slower)",
        },
        kinds=LOCAL,
        engines=frozenset({"vllm"}),
    ),
)

PARSERS = (
    Flag(
        ("--tool-call-parser",),
        "backend.tool_call_parser",
        {
            "metavar": "NAME",
            "choices": (*tool_call_parser_names(), "auto", "none"),
            "help": f"tool-call parser: {', '.join(tool_call_parser_names())}, auto (inferred from the model) or "
            "none, as vllm serve spells them",
        },
        kinds=PARSING,
    ),
    Flag(
        ("--reasoning-parser",),
        "backend.reasoning_parser",
        {
            "metavar": "NAME",
            "choices": reasoning_parser_names(),
            "help": f"reasoning parser: {', '.join(reasoning_parser_names())}",
        },
        kinds=PARSING,
    ),
)

SAMPLING = (
    Flag(
        ("--temperature",),
        "backend.sampling.temperature",
        {"type": float, "help": "sampling temperature when a request sends none; 0 is greedy (default 1.0)"},
        kinds=LOCAL,
    ),
    Flag(
        ("--top-p",),
        "backend.sampling.top_p",
        {"type": float, "help": "nucleus top-p when a request sends none (default 1.0: off)"},
        kinds=LOCAL,
    ),
    Flag(
        ("--top-k",),
        "backend.sampling.top_k",
        {"type": int, "help": "top-k when a request sends none (default off; 0 or -1: off)"},
        kinds=LOCAL,
    ),
    Flag(
        ("--min-p",),
        "backend.sampling.min_p",
        {"type": float, "help": "min-p when a request sends none (default 0: off)"},
        kinds=LOCAL,
    ),
    Flag(
        ("--seed",),
        "backend.sampling.seed",
        {
            "type": int,
            "help": "seeds every request's sampler unless it sends its own seed, so a rollout can be replayed (default: unseeded)",
        },
        kinds=LOCAL,
    ),
    Flag(
        ("--stop-token-ids",),
        "backend.sampling.stop_token_ids",
        {"type": int, "nargs": "+", "metavar": "ID", "help": "token IDs that also end a generation, besides EOS"},
        kinds=LOCAL,
    ),
    Flag(
        ("--pin-sampling",),
        "backend.sampling.pin",
        {
            "nargs": "?",
            "const": "reject",
            "choices": ("off", "reject", "override"),
            "help": "fix the sampling params to the ones above for every request, as on-policy training wants: "
            "a request sending others gets a 400 (reject, what the bare flag means) or is sampled with these "
            "(override); off (the default, as vllm serve) applies each request's own",
        },
        kinds=LOCAL,
    ),
)

SERVER = (
    Flag(("--host",), "server.host", {"help": "bind address (default 127.0.0.1)"}),
    Flag(
        ("--return-tokens-as-token-ids",),
        "server.return_tokens_as_token_ids",
        {
            "action": "store_true",
            "default": None,
            "help": "vllm serve's flag: log-prob tokens are spelled token_id:N unless a request says otherwise",
        },
    ),
    Flag(("--port",), "server.port", {"type": int, "help": "port (default 8000; 0 picks a free one)"}),
    Flag(
        ("--api-key",),
        "server.api_key",
        {
            "metavar": "KEY",
            "help": "the key clients must present (Authorization: Bearer KEY), as in vllm serve; "
            "default: $GYMSERVE_API_KEY; visible to other users in `ps`, so prefer "
            "--server-api-key-env or the environment variable",
        },
    ),
    Flag(
        ("--server-api-key-env",),
        "server.api_key",
        {"metavar": "NAME", "help": "environment variable holding the key clients must present"},
        convert=from_env("--server-api-key-env"),
    ),
    Flag(
        ("--capture",),
        "server.capture_path",
        {
            "metavar": "FILE",
            "help": "append every model call (request, response, latency, session, replica; keys "
            "redacted) to this JSONL file",
        },
    ),
)

GROUPS = (
    ("model names", (SERVED_MODEL_NAME,)),
    ("upstream (chat, openai, azure backends)", UPSTREAM),
    ("local engine (local backend, launch)", ENGINE),
    ("parsers (local and chat backends)", PARSERS),
    ("sampling params (local backend: the defaults requests may override, or pinned with --pin-sampling)", SAMPLING),
    ("this server", SERVER),
)
SERVE_FLAGS = (SERVED_MODEL_NAME, *UPSTREAM, *ENGINE, *PARSERS, *SAMPLING, *SERVER)
CHECK_FLAGS = (SERVED_MODEL_NAME, *UPSTREAM, *ENGINE, *PARSERS)
API_KEY_ENV = "GYMSERVE_API_KEY"


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """``--config``, ``--env`` and the model (positional ``MODEL``, ``--model``)."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="local: 'embedded', an embedded model's name (e.g. Qwen2.5-Coder-1.5B-Instruct, with the "
        "model-1.5b extra), a Hugging Face model directory or a .gguf file; remote: the upstream model name "
        "[config: backend.model]",
    )
    parser.add_argument("--config", help="YAML config file (see docs/reference/configuration.md); flags override it")
    parser.add_argument(
        "--env", dest="env_path", help="env.yaml with ${var} values for the config (default: beside it)"
    )
    MODEL.add_to(parser)


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag], title: str | None = None) -> None:
    """Add ``flags`` to ``parser``, under a help section ``title`` when given."""
    target = parser.add_argument_group(title) if title else parser
    for flag in flags:
        flag.add_to(target)


def add_serving_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag]) -> None:
    """Add those of ``flags`` found in the groups below, in help sections named after the groups."""
    wanted = set(flags)
    for title, group in GROUPS:
        chosen = [f for f in group if f in wanted]
        if chosen:
            add_flags(parser, chosen, title)


def _not_for(flag: Flag, kind: str) -> FlagError:
    name, kinds = flag.names[0], flag.kinds or frozenset()
    if kinds <= LOCAL and kind in REMOTE:
        why = (
            f"it sets an option of the engine gymserve runs itself, and the {kind} backend's model runs "
            "upstream: set it on the upstream server (for vLLM, on `vllm serve`)"
        )
    elif kinds <= REMOTE and kind in LOCAL:
        why = f"it configures an upstream server, and the {kind} backend runs the model in this process"
        if name == "--api-key-env":
            why += "; the key clients must present is --api-key or --server-api-key-env"
    else:
        why = f"it applies to the {' and '.join(sorted(kinds))} backend only"
    return FlagError(f"{name} does not apply to the {kind} backend: {why}")


def overrides(args: argparse.Namespace, flags: Iterable[Flag], kind: str | None) -> dict[str, Any]:
    """The given flags as ``{dotted key: value}`` for backend type ``kind`` (None: not known yet, the
    flags of every type pass). Raises ``FlagError`` for a flag that does not apply to ``kind``."""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for flag in flags:
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        if kind is not None and flag.kinds is not None and kind not in flag.kinds:
            raise _not_for(flag, kind)
        if flag.convert is not None:
            value = flag.convert(value, kind)
        key = flag.key_for(kind or "chat")
        if key in out:
            raise FlagError(f"{given[key]} and {flag.names[0]} both set {key}; give one of them")
        out[key], given[key] = value, flag.names[0]
    return out


def check_engine(args: argparse.Namespace, flags: Iterable[Flag], engine: str | None) -> None:
    """``FlagError`` for an engine-specific flag (``--tensor-parallel-size``) given with another engine."""
    for flag in flags:
        if flag.engines and getattr(args, flag.dest, None) is not None and engine not in flag.engines:
            raise FlagError(
                f"{flag.names[0]} applies to the {' and '.join(sorted(flag.engines))} engines, not "
                f"{engine}; add --engine vllm (or trtllm), or drop {flag.names[0]}"
            )


def model_override(args: argparse.Namespace) -> dict[str, Any]:
    """``backend.model`` from the positional ``MODEL`` or ``--model``; ``FlagError`` when both differ."""
    positional, named = getattr(args, "model_tag", None), getattr(args, "model", None)
    if positional and named and positional != named:
        raise FlagError(
            f"the model is given twice ({positional!r} and --model {named!r}); give it once, as `gymserve serve MODEL`"
        )
    model = positional or named
    return {"backend.model": model} if model else {}


def nest(dotted: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1}`` -> ``{"a": {"b": 1}}``."""
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def kind_of(args: argparse.Namespace) -> str | None:
    """The backend type the flags name: ``--backend``, else chat when ``--base-url`` is given."""
    return getattr(args, "backend", None) or ("chat" if getattr(args, "base_url", None) else None)


def config_from_args(args: argparse.Namespace, flags: Iterable[Flag], *, kind: str | None = None, serving: bool = True):
    """The ``GymserveConfig``: ``--config`` (and ``--env``) with ``flags`` applied on top.

    ``kind`` forces the backend type (``launch``: ray). Otherwise it comes from the flags, else from
    the file, so a flag that does not apply to the file's backend is named (``FlagError``) rather
    than turned into an "extra inputs are not permitted" on a key the user never wrote. ``serving``:
    the server key falls back to ``$GYMSERVE_API_KEY`` when neither a flag nor the file sets one.
    Raises ``ConfigError`` (``FlagError`` included).
    """
    from pydantic import SecretStr

    from gymserve.config import load_config

    def load(dotted: dict[str, Any]):
        return load_config(
            getattr(args, "config", None), env_path=getattr(args, "env_path", None), overrides=nest(dotted)
        )

    kind = kind or kind_of(args)
    base = {**model_override(args), **({"backend.type": kind} if kind else {})}
    if kind is None:
        try:
            kind = load(base).backend.type
        except ConfigError:
            pass  # a flag may be what makes the file valid: apply them all and let validation speak
    config = load({**base, **overrides(args, flags, kind)})
    backend = getattr(config.backend, "local", config.backend)
    check_engine(args, flags, getattr(backend, "engine", None))
    if serving and config.server.api_key is None and os.environ.get(API_KEY_ENV):
        config.server.api_key = SecretStr(os.environ[API_KEY_ENV])
    return config


def serve_overrides(
    args: argparse.Namespace, flags: Iterable[Flag] = SERVE_FLAGS, kind: str | None = None
) -> dict[str, Any]:
    """The flags of ``args`` as nested overrides for ``load_config`` (the type from the flags or
    ``kind``); what ``config_from_args`` applies, without reading the file."""
    kind = kind or kind_of(args)
    return nest({**model_override(args), **({"backend.type": kind} if kind else {}), **overrides(args, flags, kind)})
