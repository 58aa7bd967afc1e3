"""The ``gymserve`` command: serve, launch, status, check, demo, rollout, verify-rollouts.

Flags cover the common case; everything else comes from ``--config FILE`` (YAML, see
``gymserve.config``). A flag given on the command line overrides the same key in the file.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from gymserve._version import __version__


def _serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Command-line flags as a nested override dict for ``load_config``."""
    backend: dict[str, Any] = {}
    server: dict[str, Any] = {}
    kind = args.backend or ("chat" if args.base_url else None)
    if kind:
        backend["type"] = kind
    if args.model:
        backend["model"] = args.model
    if args.base_url:
        if kind == "chat":
            backend["base_urls"] = args.base_url
        elif kind == "azure":
            backend["endpoint"] = args.base_url[0]
        elif kind in ("openai",):
            backend["base_url"] = args.base_url[0]
        else:
            raise SystemExit(f"gymserve: --base-url does not apply to the {kind} backend")
    if getattr(args, "api_version", None):
        backend["api_version"] = args.api_version
    if args.api_key_env:
        if args.api_key_env not in os.environ:
            raise SystemExit(f"gymserve: --api-key-env {args.api_key_env}: that environment variable is not set")
        backend["api_key"] = os.environ[args.api_key_env]
    for flag, key in (("tool_call_parser", "tool_parser"), ("reasoning_parser", "reasoning_parser"),
                      ("chat_template", "chat_template"), ("engine", "engine")):
        if getattr(args, flag, None):
            backend[key] = getattr(args, flag)
    if args.host:
        server["host"] = args.host
    if args.port is not None:
        server["port"] = args.port
    if args.server_api_key_env:
        if args.server_api_key_env not in os.environ:
            raise SystemExit(f"gymserve: --server-api-key-env {args.server_api_key_env}: that environment "
                             "variable is not set")
        server["api_key"] = os.environ[args.server_api_key_env]
    if getattr(args, "capture", None):
        server["capture_path"] = args.capture
    out: dict[str, Any] = {}
    if backend:
        out["backend"] = backend
    if server:
        out["server"] = server
    return out


def _add_backend_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (see docs/reference/configuration.md)")
    p.add_argument("--env", dest="env_path", help="env.yaml with ${var} values for the config (default: beside it)")
    p.add_argument("--backend", choices=["local", "chat", "openai", "azure"],
                   help="where the model runs (default: local, the embedded model)")
    p.add_argument("--model", help="local: 'embedded', an HF model directory or a .gguf file; "
                                   "remote: the upstream model name")
    p.add_argument("--base-url", action="append",
                   help="upstream base URL ending in /v1 (implies --backend chat); repeat for replicas; "
                        "azure: the resource endpoint")
    p.add_argument("--api-version", help="azure: the api-version query parameter sent on every request")
    p.add_argument("--api-key-env", help="name of the environment variable holding the upstream API key")
    p.add_argument("--engine", help="local inference engine (default: transformers)")
    p.add_argument("--tool-call-parser", help="tool-call parser name, or 'auto' (as vllm serve spells it)")
    p.add_argument("--reasoning-parser", help="reasoning parser name (deepseek_r1, qwen3)")
    p.add_argument("--chat-template", help="Jinja chat template file overriding the tokenizer's")


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree (also used to generate docs/reference/cli.md)."""
    parser = argparse.ArgumentParser(
        prog="gymserve", description="Token-exact Responses API and Chat Completions serving for RL of LLM agents.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"gymserve {__version__}",
                        help="print the version (gymserve.__version__) and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve /v1/responses and /v1/chat/completions over a backend")
    _add_backend_flags(serve)
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--server-api-key-env", help="environment variable holding the key clients must present")
    serve.add_argument("--capture", metavar="FILE",
                       help="append every model call (request, response, latency, session, replica; keys "
                            "redacted) to this JSONL file")
    serve.add_argument("--replicas", type=int, help="local backend only: serve N engine replicas on Ray "
                                                   "(same as `gymserve launch --replicas N`)")
    serve.add_argument("--ray-address", help="with --replicas: the Ray cluster to join (see `gymserve launch`)")

    from gymserve.ray_cluster.cli import add_launch_parser, add_status_parser

    add_launch_parser(sub)
    add_status_parser(sub)

    check = sub.add_parser("check", help="probe a configured backend and say what works and what to change")
    _add_backend_flags(check)
    check.set_defaults(host=None, port=None, server_api_key_env=None, capture=None)

    demo = sub.add_parser("demo", help="run the weather agent on the embedded model and verify the rollout")
    demo.add_argument("--base-url", help="use a running Responses endpoint instead of the embedded model")
    demo.add_argument("--model", help="model name at --base-url, or a local model for the in-process server")
    demo.add_argument("--verify-model", help="local model directory for teacher forcing with --base-url")
    demo.add_argument("--max-output-tokens", type=int, help="per model call (default: run_demo's)")

    roll = sub.add_parser("rollout", help="collect rollouts from a JSONL file of tasks")
    roll.add_argument("--input", required=True, help="tasks JSONL (one Responses create request + env per line)")
    roll.add_argument("--output", required=True, help="rollouts JSONL (appended, one finished rollout per line)")
    roll.add_argument("--base-url", help="Responses endpoint (default: serve the embedded model in process)")
    roll.add_argument("--model", help="model name at --base-url, or a local model for the in-process server")
    roll.add_argument("--concurrency", type=int, default=8)
    roll.add_argument("--resume", action="store_true", help="skip tasks whose rollout is already in --output")

    from gymserve.harness.rl_loop import add_train_demo_parser

    add_train_demo_parser(sub)

    ver = sub.add_parser("verify-rollouts", help="check token contiguity and recompute log-probs by teacher forcing")
    ver.add_argument("path", help="rollouts JSONL")
    ver.add_argument("--model", help="model to recompute log-probs with (default: the embedded model)")
    return parser


def _load(args: argparse.Namespace):
    from gymserve.config import load_config

    return load_config(args.config, env_path=args.env_path, overrides=_serve_overrides(args))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gymserve`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI prints a message, not a traceback, for known errors
        from pydantic import ValidationError

        from gymserve.engine.model_store import ModelStoreError
        from gymserve.errors import GymserveError

        if isinstance(exc, (ModelStoreError, GymserveError, ValidationError, ValueError, ImportError, OSError)):
            print(f"gymserve: {exc}", file=sys.stderr)
            return 2
        raise


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "launch" or (args.command == "serve" and args.replicas):
        from gymserve.ray_cluster.cli import main_launch

        return main_launch(args)
    if args.command == "status":
        from gymserve.ray_cluster.cli import main_status

        return main_status(args.base_url)
    if args.command == "serve":
        from gymserve.server.run import run_event_loop, serve_async

        config = _load(args)
        print(f"gymserve: serving {config.backend.type} backend on http://{config.server.host}:"
              f"{config.server.port}/v1", file=sys.stderr)
        run_event_loop(serve_async(config))
        return 0
    if args.command == "train-demo":
        from gymserve.harness.rl_loop import main_train_demo

        return main_train_demo(args)
    if args.command == "check":
        from gymserve.check import main_check

        return main_check(_load(args))
    if args.command == "demo":
        from gymserve.harness.demo import run_demo

        kwargs = {"max_output_tokens": args.max_output_tokens} if args.max_output_tokens else {}
        return run_demo(base_url=args.base_url, model=args.model, verify_model=args.verify_model, **kwargs)
    if args.command == "rollout":
        from gymserve.harness.rollout import main_rollout

        return main_rollout(args.input, args.output, base_url=args.base_url, concurrency=args.concurrency,
                            resume=args.resume, model=args.model)
    if args.command == "verify-rollouts":
        from gymserve.harness.verify import main_verify

        return main_verify(args.path, model=args.model)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
