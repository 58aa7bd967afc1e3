"""Routing calls across the replicas of one model: which replica serves a call, and what a failure does.

- ``base.RoutingPolicy`` and one module per policy, registered by name in
  ``gymserve.registry.ROUTING_POLICIES`` (``routing.policy`` in the config): ``sticky-least-loaded``
  (the default), ``round-robin``, ``consistent-hash``;
- ``sessions.SessionTable``: session → replica, active sessions, the prefix-hit estimate;
- ``breaker.CircuitBreaker``: each replica's passive health (closed → open → half-open);
- ``retry_budget.RetryBudget``: retries as a fraction of recent successful calls.

``backends.pool.ReplicaPool`` puts them together; the chat backend's ``caller.UpstreamCaller`` and
the Ray backend both route through it. See docs/model-servers/vllm.md and docs/scaling.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gymserve.backends.routing.base import RoutingPolicy
from gymserve.backends.routing.breaker import CircuitBreaker
from gymserve.backends.routing.retry_budget import RetryBudget
from gymserve.backends.routing.sessions import SessionTable
from gymserve.registry import ROUTING_POLICIES

__all__ = ["ROUTING_POLICIES", "CircuitBreaker", "RetryBudget", "RoutingPolicy", "SessionTable", "policy_for"]


def policy_for(name: str, replicas: Sequence[Any], config: object) -> RoutingPolicy:
    """The policy registered as ``name`` over ``replicas``; raises ``UnknownNameError`` (a
    ``ValueError`` listing the choices) for an unregistered name."""
    return ROUTING_POLICIES.get(name)(replicas, config)
