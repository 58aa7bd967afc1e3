"""The Ray backend's real routing class over an in-process replica (``EngineReplica`` serving a
local backend in this process): no Ray cluster, same calls."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class InProcessActor:
    """What ``RayBackend`` calls on a Ray actor handle (``handle.method.remote(...)``, awaited),
    served by an ``EngineReplica`` in this process."""

    def __init__(self, replica: Any):
        self._replica = replica

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._replica, name)
        return SimpleNamespace(remote=lambda *args: method(*args))


async def ray_over(local: Any, local_config: Any) -> Any:
    """A ``RayBackend`` with one replica, ``local`` (a ``LocalBackend`` built from ``local_config``)."""
    from gymserve.config import RayBackendConfig
    from gymserve.ray_cluster.backend import RayBackend
    from gymserve.ray_cluster.fleet import RayReplica
    from gymserve.ray_cluster.replica import EngineReplica

    config = RayBackendConfig.model_validate(
        {"type": "ray", "health_check_interval": 0, "local": local_config.model_dump()}
    )
    replica = EngineReplica.serving("replica-0", local)
    return RayBackend(
        config, [RayReplica(base_url="replica-0", client=InProcessActor(replica))], [await replica.info()]
    )
