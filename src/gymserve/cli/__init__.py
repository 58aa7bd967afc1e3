"""The ``gymserve`` command: serve, launch, status, check, demo, rollout, train-demo, verify-rollouts.

``gymserve serve [MODEL]`` reads like ``vllm serve MODEL``; every flag sets one config key
(``gymserve.cli.flags``), and everything else comes from ``--config FILE`` (YAML, see
``gymserve.config``), which the flags override. No option is matched by a prefix of its name
(``allow_abbrev=False`` everywhere): ``--api-key`` is the server's key, ``--api-key-env`` the
upstream's, and a typo is an error.

Failures print one line (``gymserve.failures``): the message of a known error, or for a bug what
failed and where, plus the file holding the traceback; ``--debug`` (or ``GYMSERVE_DEBUG=1``)
prints the traceback instead.
Exit codes: 0 success, 1 a bug (or a failed check), 2 a usage, config, model or upstream error,
130 interrupted; ``serve``: ``128 + N`` when signal N killed the server (``gymserve.cli.supervise``:
``serve`` runs the server in a child process and says in one line what killed it; ``serve``,
``launch`` and ``demo`` enable ``faulthandler``, so a native crash prints the Python backtrace).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from gymserve.cli.flags import (
    CHECK_FLAGS,
    SERVE_FLAGS,
    FlagError,
    add_config_flags,
    add_flags,
    add_serving_flags,
    config_from_args,
    serve_overrides,
)
from gymserve.registry import ENGINES

__all__ = ["build_parser", "config_from_args", "main", "run_server", "serve_overrides", "version"]


def version() -> str:
    """gymserve's version, from its one source, ``gymserve._version`` (also ``gymserve.__version__``)."""
    from gymserve._version import __version__

    return __version__


def _common() -> argparse.ArgumentParser:
    """Options every command takes, before or after its name (``gymserve --debug demo`` and
    ``gymserve demo --debug``). SUPPRESS defaults keep a subcommand from resetting a value given
    before it."""
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO level")
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="on failure, print the full traceback (default: one line, the traceback to a log file)",
    )
    return common


# As `vllm serve` prints it: MODEL goes first, before any option that takes several values
# (`--served-model-name A B MODEL` would read MODEL as a third name).
MODEL_FIRST = "%(prog)s [MODEL] [options]"


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree (also used to generate docs/reference/cli.md)."""
    common = _common()
    sub_options: dict[str, Any] = {"allow_abbrev": False, "parents": [common]}
    parser = argparse.ArgumentParser(
        prog="gymserve",
        allow_abbrev=False,
        parents=[common],
        description="Token-exact Responses API and Chat Completions serving for RL of LLM agents.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {version()}",
        help="print the version (gymserve.__version__) and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from gymserve.ray_cluster.cli import add_launch_parser, add_status_parser, serve_ray_flags

    serve = sub.add_parser(
        "serve",
        help="serve /v1/responses and /v1/chat/completions over a backend",
        usage=MODEL_FIRST,
        description="Serve MODEL (default: the embedded model) or an upstream at /v1/responses and "
        "/v1/chat/completions, like `vllm serve MODEL`. Flags override --config.",
        **sub_options,
    )
    add_config_flags(serve)
    add_serving_flags(serve, SERVE_FLAGS)
    add_flags(serve, serve_ray_flags(), "replicas on Ray (as gymserve launch)")

    add_launch_parser(sub, **sub_options)
    add_status_parser(sub, **sub_options)

    check = sub.add_parser(
        "check",
        help="probe a configured backend and say what works and what to change",
        usage=MODEL_FIRST,
        **sub_options,
    )
    add_config_flags(check)
    add_serving_flags(check, CHECK_FLAGS)

    demo = sub.add_parser(
        "demo", help="run the weather agent on the embedded model and verify the rollout", **sub_options
    )
    demo.add_argument("--base-url", help="use a running Responses endpoint instead of the embedded model")
    demo.add_argument(
        "--model",
        help="model name at --base-url, or a local model for the in-process server (an embedded model's name, "
        "a directory or a .gguf; default: the demo's model)",
    )
    demo.add_argument(
        "--engine",
        choices=ENGINES.names(),
        help="local engine of the in-process server, which also teacher-forces (default: llamacpp; with "
        "--base-url, the engine that teacher-forces --verify-model: transformers)",
    )
    demo.add_argument("--verify-model", help="local model directory for teacher forcing with --base-url")
    demo.add_argument("--max-output-tokens", type=int, help="per model call (default: run_demo's)")

    roll = sub.add_parser("rollout", help="collect rollouts from a JSONL file of tasks", **sub_options)
    roll.add_argument("--input", required=True, help="tasks JSONL (one Responses create request + env per line)")
    roll.add_argument("--output", required=True, help="rollouts JSONL (appended, one finished rollout per line)")
    roll.add_argument("--base-url", help="Responses endpoint (default: serve the embedded model in process)")
    roll.add_argument("--model", help="model name at --base-url, or a local model for the in-process server")
    roll.add_argument("--concurrency", type=int, default=8, help="rollouts in flight at once")
    roll.add_argument("--resume", action="store_true", help="skip tasks whose rollout is already in --output")

    from gymserve.harness.rl_loop import add_train_demo_parser

    add_train_demo_parser(sub, **sub_options)

    ver = sub.add_parser(
        "verify-rollouts", help="check token contiguity and recompute log-probs by teacher forcing", **sub_options
    )
    ver.add_argument("path", help="rollouts JSONL")
    ver.add_argument("--model", help="model to recompute log-probs with (default: the embedded model)")
    ver.add_argument(
        "--weights",
        action="append",
        default=[],
        metavar="VERSION=DIR",
        help="the weights of one version (a model directory, a .gguf with --engine llamacpp, or a LoRA adapter "
        "on --model); repeat per "
        "version: each token is then checked on the version that sampled it",
    )
    ver.add_argument(
        "--engine",
        choices=("transformers", "llamacpp"),
        default="transformers",
        help="engine that served the rollouts and recomputes their log-probs (default: transformers)",
    )
    ver.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="the largest |log-prob - teacher forcing| that passes (default: 1e-4; 0.5 for quantized GGUF "
        "weights on --engine llamacpp, with the reason printed)",
    )
    return parser


def _backend_words(config) -> str:
    """``local backend`` / ``ray backend, 2 replicas`` / ``chat backend, 2 replicas`` for start-up lines."""
    backend = config.backend
    count = getattr(backend, "replicas", None) or len(getattr(backend, "base_urls", None) or [])
    return f"{backend.type} backend" + (f", {count} replicas" if isinstance(count, int) and count > 1 else "")


def run_server(config) -> int:
    """Serve ``config`` in the foreground until SIGINT/SIGTERM (``gymserve serve`` and ``launch``).

    Says "starting" before the backend loads and "serving MODEL ... on URL" only once the port
    accepts connections (MODEL: the name clients send, as ``/v1/models`` lists it). Raises
    ``server.run.BindError`` (before any model loads) when the port is taken.
    """
    from gymserve.server.run import run_event_loop, serve_async

    backend = getattr(config.backend, "local", config.backend)
    what = _backend_words(config)
    print(
        f"gymserve: starting the {what} (model {getattr(backend, 'model', None) or 'from the upstream'}); "
        "it answers once it prints 'serving'",
        file=sys.stderr,
        flush=True,
    )

    def started(base_url: str, models: list[str]) -> None:
        names = (
            ", also as ".join([models[0], ", ".join(models[1:])] if len(models) > 1 else models)
            or "the upstream's models"
        )
        print(f"gymserve: serving {names} ({what}) on {base_url}", file=sys.stderr, flush=True)

    run_event_loop(serve_async(config, on_started=started))
    return 0


def _serve(args: argparse.Namespace) -> int:
    if not args.replicas:
        return run_server(config_from_args(args, SERVE_FLAGS))
    from gymserve.ray_cluster.cli import serve_ray_flags

    if args.backend not in (None, "local"):
        raise FlagError(
            f"--replicas serves replicas of the local engine on Ray; it does not apply to the "
            f"{args.backend} backend (for replicas of a chat server, repeat --base-url)"
        )
    args.backend = None
    return run_server(config_from_args(args, SERVE_FLAGS + serve_ray_flags(), kind="ray"))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gymserve`` console script; returns the exit code (see the module docstring)."""
    args = build_parser().parse_args(argv)
    from gymserve.cli.supervise import should_supervise, supervise

    if should_supervise(args.command, argv):
        return supervise(sys.argv[1:])
    if args.command in ("serve", "launch", "demo"):
        _enable_faulthandler()
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from gymserve.failures import DEBUG_ENV, report

    if getattr(args, "debug", False):
        os.environ[DEBUG_ENV] = "1"  # commands that report their own failures (demo, rollout) follow it
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear line (gymserve.failures)
        return report(exc, args.command)


def _enable_faulthandler() -> None:
    """A crash in native code (llama.cpp, torch) prints the Python backtrace of every thread to
    stderr before the process dies (``faulthandler``); under pytest or another tool that enabled it
    already, that one stays. stderr without a file descriptor (a captured stream): nothing."""
    import faulthandler

    if faulthandler.is_enabled():
        return
    try:
        faulthandler.enable(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is an OSError and a ValueError
        return


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return _serve(args)
    if args.command == "launch":
        from gymserve.ray_cluster.cli import main_launch

        return main_launch(args)
    if args.command == "status":
        from gymserve.ray_cluster.cli import main_status

        return main_status(args.base_url)
    if args.command == "check":
        from gymserve.check import main_check

        return main_check(config_from_args(args, CHECK_FLAGS, serving=False))
    if args.command == "demo":
        from gymserve.harness.demo import run_demo

        kwargs = {"max_output_tokens": args.max_output_tokens} if args.max_output_tokens else {}
        return run_demo(
            base_url=args.base_url, model=args.model, engine=args.engine, verify_model=args.verify_model, **kwargs
        )
    if args.command == "rollout":
        from gymserve.harness.rollout import main_rollout

        return main_rollout(
            args.input,
            args.output,
            base_url=args.base_url,
            concurrency=args.concurrency,
            resume=args.resume,
            model=args.model,
        )
    if args.command == "train-demo":
        from gymserve.harness.rl_loop import main_train_demo

        return main_train_demo(args)
    if args.command == "verify-rollouts":
        from gymserve.harness.verify import main_verify

        return main_verify(
            args.path, model=args.model, tolerance=args.tolerance, weights=args.weights, engine=args.engine
        )
    raise AssertionError(args.command)
