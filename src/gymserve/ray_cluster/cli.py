"""``gymserve launch`` (N replicas on Ray behind one front end) and ``gymserve status`` (the replica table).

To wire into ``gymserve.cli``::

    from gymserve.ray_cluster.cli import add_launch_parser, add_status_parser, main_launch, main_status
    add_launch_parser(sub); add_status_parser(sub)
    ...
    if args.command == "launch": return main_launch(args)
    if args.command == "status": return main_status(args.base_url)

Nothing here imports ray until ``main_launch`` builds the backend.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def add_launch_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``launch`` to an argparse subparsers object; returns the new parser."""
    p = subparsers.add_parser(
        "launch", help="serve N local-engine replicas on a Ray cluster behind one gymserve front end",
        description="Start N replicas of a local model as Ray actors (on the cluster at --ray-address, or a "
                    "local Ray instance) and serve them at one OpenAI-compatible endpoint with session affinity.")
    p.add_argument("--config", help="YAML config file; its backend section may be type ray or local")
    p.add_argument("--env", dest="env_path", help="env.yaml with ${var} values for the config (default: beside it)")
    p.add_argument("--model", help="'embedded', an HF model directory or a .gguf file, present on every node")
    p.add_argument("--replicas", type=int, help="number of replicas (default 1)")
    p.add_argument("--ray-address", help="Ray cluster to join: 'auto', HOST:6379 or ray://HOST:10001 "
                                         "(default: RAY_ADDRESS, a cluster started on this machine, else a new "
                                         "local instance); 'local' always starts a new one")
    p.add_argument("--num-cpus", type=float, help="CPUs reserved per replica (default 1)")
    p.add_argument("--num-gpus", type=float, help="GPUs reserved per replica (default 0)")
    p.add_argument("--placement-strategy", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
                   help="how replicas' bundles are placed on nodes (default PACK)")
    p.add_argument("--engine", help="local inference engine (default: transformers)")
    p.add_argument("--tool-call-parser", help="tool-call parser name, or 'auto'")
    p.add_argument("--reasoning-parser", help="reasoning parser name (deepseek_r1, qwen3)")
    p.add_argument("--chat-template", help="Jinja chat template file (must exist on every node)")
    p.add_argument("--host", help="front end bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="front end port (default 8000)")
    p.add_argument("--server-api-key-env", help="environment variable holding the key clients must present")
    return p


def add_status_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``status`` (print a running server's replica table) to an argparse subparsers object."""
    p = subparsers.add_parser("status", help="show a running gymserve's replicas: state, load, sessions, restarts")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server (default %(default)s)")
    return p


def launch_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``launch`` flags as nested overrides for ``gymserve.config.load_config``; always ``backend.type: ray``.

    A config file whose backend is ``type: local`` becomes a ray backend with the same local options
    (``RayBackendConfig`` gathers them). Raises ``SystemExit`` for an unset ``--server-api-key-env``.
    """
    backend: dict[str, Any] = {"type": "ray"}
    server: dict[str, Any] = {}
    resources: dict[str, Any] = {}
    for flag, key in (("model", "model"), ("replicas", "replicas"), ("ray_address", "ray_address"),
                      ("placement_strategy", "placement_strategy"), ("engine", "engine"),
                      ("tool_call_parser", "tool_parser"), ("reasoning_parser", "reasoning_parser"),
                      ("chat_template", "chat_template")):
        if getattr(args, flag, None) is not None:
            backend[key] = getattr(args, flag)
    for flag, key in (("num_cpus", "num_cpus"), ("num_gpus", "num_gpus")):
        if getattr(args, flag, None) is not None:
            resources[key] = getattr(args, flag)
    if resources:
        backend["replica_resources"] = resources
    if getattr(args, "host", None):
        server["host"] = args.host
    if getattr(args, "port", None) is not None:
        server["port"] = args.port
    env = getattr(args, "server_api_key_env", None)
    if env:
        if env not in os.environ:
            raise SystemExit(f"gymserve: --server-api-key-env {env}: that environment variable is not set")
        server["api_key"] = os.environ[env]
    return {"backend": backend, **({"server": server} if server else {})}


def load_launch_config(args: argparse.Namespace):
    """The ``GymserveConfig`` for ``launch``: the file (if any) with the flags applied on top."""
    from gymserve.config import load_config

    return load_config(getattr(args, "config", None), env_path=getattr(args, "env_path", None),
                       overrides=launch_overrides(args))


def main_launch(args: argparse.Namespace) -> int:
    """Start the replicas and serve until SIGINT/SIGTERM; then the replicas are killed and a Ray
    instance started here is stopped. Returns the exit code (0)."""
    from gymserve.server.run import run_event_loop, serve_async

    config = load_launch_config(args)
    b = config.backend
    where = b.ray_address or "a local Ray instance (or the one RAY_ADDRESS / `ray start` names)"
    print(f"gymserve: starting {b.replicas} replica(s) of {b.local.model} on {where}; front end at "
          f"http://{config.server.host}:{config.server.port}/v1", file=sys.stderr)
    run_event_loop(serve_async(config))
    return 0


def format_status(health: dict[str, Any]) -> str:
    """The replica table of a ``/health`` answer (ray backend rows, or a chat backend's pool rows)."""
    rows = [("NAME", "STATE", "IN_FLIGHT", "SESSIONS", "NODE", "RESTARTS")]
    for r in health.get("replicas") or []:
        state = r.get("state") or ("alive" if r.get("healthy", True) else "unhealthy")
        rows.append((str(r.get("name") or r.get("base_url")), state, str(r.get("in_flight", "-")),
                     str(r.get("sessions", "-")), str(r.get("node") or "-"), str(r.get("restarts", "-"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"status: {health.get('status')}  backend: {health.get('backend', '-')}  model: {health.get('model', '-')}"]
    if len(rows) > 1:
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    else:
        lines.append("(this backend reports no replicas)")
    return "\n".join(lines)


def main_status(base_url: str = "http://127.0.0.1:8000/v1", *, api_key: str | None = None, timeout: float = 30.0) -> int:
    """Print the server's replica table (``GET /health``, which needs no API key; ``api_key`` is for a
    proxy in front that does). Exit code: 0 all replicas up, 1 degraded or down, 2 unreachable."""
    import httpx

    root = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{root}/health", headers=headers, timeout=timeout)
        health = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        print(f"gymserve: cannot read {root}/health ({type(exc).__name__}: {exc}); is the server running?",
              file=sys.stderr)
        return 2
    if resp.status_code not in (200, 503) or "status" not in health:
        print(f"gymserve: {root}/health answered {resp.status_code}: {resp.text[:300]}", file=sys.stderr)
        return 2
    print(format_status(health))
    return 0 if health.get("status") == "ok" else 1
