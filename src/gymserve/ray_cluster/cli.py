"""``gymserve launch`` (N replicas on Ray behind one front end) and ``gymserve status`` (the replica table).

``gymserve.cli`` adds both parsers; ``launch`` shares ``serve``'s flags where they apply to replicas
of a local engine (``gymserve.cli.flags``). Nothing here imports ray until the backend is built.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any


@functools.cache
def _ray_flags():
    from gymserve.cli.flags import Flag

    ray = frozenset({"ray"})
    replicas = Flag(
        ("--replicas",),
        "backend.replicas",
        {
            "type": int,
            "help": "local engine only: serve N replicas of it on Ray (default 1; `gymserve serve --replicas "
            "N` is `gymserve launch --replicas N`)",
        },
        kinds=ray,
    )
    address = Flag(
        ("--ray-address",),
        "backend.ray_address",
        {
            "metavar": "ADDRESS",
            "help": "Ray cluster to join: 'auto', HOST:6379 or ray://HOST:10001 (default: "
            "RAY_ADDRESS, a cluster started on this machine, else a new local instance); "
            "'local' always starts a new one",
        },
        kinds=ray,
    )
    placement = (
        Flag(
            ("--num-cpus",),
            "backend.replica_resources.num_cpus",
            {"type": float, "help": "CPUs reserved per replica; also its torch threads (default 1)"},
            kinds=ray,
        ),
        Flag(
            ("--num-gpus",),
            "backend.replica_resources.num_gpus",
            {"type": float, "help": "GPUs reserved per replica (default 0)"},
            kinds=ray,
        ),
        Flag(
            ("--placement-strategy",),
            "backend.placement_strategy",
            {
                "choices": ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
                "help": "how replicas' bundles are placed on nodes (default PACK)",
            },
            kinds=ray,
        ),
    )
    return replicas, address, placement


def launch_flags() -> tuple:
    """Every flag of ``gymserve launch``: the Ray ones, then those of ``serve`` that apply to replicas of a
    local engine (model, engine, parsers, sampling, server)."""
    from gymserve.cli.flags import ENGINE, PARSERS, SAMPLING, SERVED_MODEL_NAME, SERVER

    replicas, address, placement = _ray_flags()
    return (replicas, address, *placement, SERVED_MODEL_NAME, *ENGINE, *PARSERS, *SAMPLING, *SERVER)


def serve_ray_flags() -> tuple:
    """The Ray flags ``gymserve serve`` has too (``serve --replicas N`` is ``launch --replicas N``)."""
    replicas, address, _ = _ray_flags()
    return replicas, address


def add_launch_parser(subparsers, **kwargs) -> argparse.ArgumentParser:
    """Add ``launch`` to an argparse subparsers object (``kwargs`` go to ``add_parser``); returns it."""
    from gymserve.cli.flags import add_config_flags, add_flags, add_serving_flags

    p = subparsers.add_parser(
        "launch",
        help="serve N local-engine replicas on a Ray cluster behind one gymserve front end",
        description="Start N replicas of a local model as Ray actors (on the cluster at --ray-address, or a "
        "local Ray instance) and serve them at one OpenAI-compatible endpoint with session affinity. "
        "MODEL (or --model) must be present on every node.",
        usage="%(prog)s [MODEL] [options]",
        **kwargs,
    )
    add_config_flags(p)
    replicas, address, placement = _ray_flags()
    add_flags(p, (replicas, address, *placement), "replicas on Ray")
    add_serving_flags(p, launch_flags())
    return p


def add_status_parser(subparsers, **kwargs) -> argparse.ArgumentParser:
    """Add ``status`` (print a running server's replica table) to an argparse subparsers object."""
    p = subparsers.add_parser(
        "status",
        help="show a running gymserve's replicas: state, circuit breaker, load, sessions, prefix hits, restarts",
        **kwargs,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server (default %(default)s)")
    return p


def launch_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``launch`` flags as nested overrides for ``gymserve.config.load_config``; always ``backend.type: ray``.

    A config file whose backend is ``type: local`` becomes a ray backend with the same local options
    (``RayBackendConfig`` gathers them). Raises ``FlagError`` for an unset ``--server-api-key-env``.
    """
    from gymserve.cli.flags import serve_overrides

    return serve_overrides(args, launch_flags(), kind="ray")


def load_launch_config(args: argparse.Namespace):
    """The ``GymserveConfig`` for ``launch``: the file (if any) with the flags applied on top."""
    from gymserve.cli.flags import config_from_args

    return config_from_args(args, launch_flags(), kind="ray")


def main_launch(args: argparse.Namespace) -> int:
    """Start the replicas and serve until SIGINT/SIGTERM; then the replicas are killed and a Ray
    instance started here is stopped. Returns the exit code (0)."""
    from gymserve.cli import run_server

    return run_server(load_launch_config(args))


def format_status(health: dict[str, Any]) -> str:
    """The replica table of a ``/health`` answer (ray backend rows, or a chat backend's pool rows):
    per replica its state, circuit breaker, calls in flight, sessions (active / remembered), the
    router's prefix-hit estimate, failures, and for Ray its node and restarts."""
    rows = [("NAME", "STATE", "BREAKER", "IN_FLIGHT", "SESSIONS", "PREFIX_HIT", "FAILURES", "NODE", "RESTARTS")]
    for r in health.get("replicas") or []:
        state = r.get("state") or ("alive" if r.get("healthy", True) else "unhealthy")
        sessions = str(r.get("sessions", "-"))
        if r.get("active_sessions") is not None:
            sessions = f"{r['active_sessions']}/{sessions}"
        hit = r.get("prefix_hit_estimate")
        rows.append(
            (
                str(r.get("name") or r.get("base_url")),
                state,
                str(r.get("breaker", "-")).replace("_", "-"),
                str(r.get("in_flight", "-")),
                sessions,
                f"{100 * hit:.0f}%" if isinstance(hit, (int, float)) else "-",
                str(r.get("failures", "-")),
                str(r.get("node") or "-"),
                str(r.get("restarts", "-")),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    head = f"status: {health.get('status')}  backend: {health.get('backend', '-')}  model: {health.get('model', '-')}"
    if health.get("routing"):
        head += f"  routing: {health['routing']}"
    budget = health.get("retry_budget")
    if isinstance(budget, dict):
        head += (
            f"  retry budget: {budget.get('balance')} left, {budget.get('retries')} used, {budget.get('denied')} denied"
        )
    lines = [head]
    if len(rows) > 1:
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    else:
        lines.append("(this backend reports no replicas)")
    return "\n".join(lines)


def main_status(
    base_url: str = "http://127.0.0.1:8000/v1", *, api_key: str | None = None, timeout: float = 30.0
) -> int:
    """Print the server's replica table (``GET /health``, which needs no API key; ``api_key`` is for a
    proxy in front that does). Exit code: 0 all replicas up, 1 degraded or down, 2 unreachable."""
    import httpx

    root = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{root}/health", headers=headers, timeout=timeout)
        health = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        print(
            f"gymserve: cannot read {root}/health ({type(exc).__name__}: {exc}); is the server running?",
            file=sys.stderr,
        )
        return 2
    if resp.status_code not in (200, 503) or "status" not in health:
        print(f"gymserve: {root}/health answered {resp.status_code}: {resp.text[:300]}", file=sys.stderr)
        return 2
    print(format_status(health))
    return 0 if health.get("status") == "ok" else 1
