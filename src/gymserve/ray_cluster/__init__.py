"""Scaling on Ray: N local-engine replicas as Ray actors behind one gymserve front end.

- ``replica.EngineReplica``: the actor class; each one builds a token-exact ``LocalBackend``.
- ``backend.RayBackend``: the gymserve ``Backend`` that routes across the actors with the shared
  ``ReplicaPool`` (session affinity, health probes, failover to another replica).
- ``cli``: ``gymserve launch`` and ``gymserve status``.

Nothing here imports ``ray`` at module import time, so the CLI's parser and the config work on an
install without the ``ray`` extra; building a ``RayBackend`` then says what to install.
See docs/scaling.md for why Ray core actors and not Ray Serve.
"""

from __future__ import annotations

__all__ = ["RayBackend", "EngineReplica"]


def __getattr__(name: str):
    # Lazy: ``from gymserve.ray_cluster import RayBackend`` imports ray only when asked.
    if name == "RayBackend":
        from gymserve.ray_cluster.backend import RayBackend

        return RayBackend
    if name == "EngineReplica":
        from gymserve.ray_cluster.replica import EngineReplica

        return EngineReplica
    raise AttributeError(name)
