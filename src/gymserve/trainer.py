"""The trainer's side of process-group weight sync: a trainer process (torch and gymserve only)
opens a ``torch.distributed`` group with a running gymserve and broadcasts its weights to it.

::

    from gymserve.trainer import WeightSender

    with WeightSender("http://127.0.0.1:8000") as sender:        # joins the group (rank 0)
        for step in range(steps):
            ...train...
            sender.send(model.state_dict(), weight_version=step + 1)   # all or nothing

The HTTP side speaks vLLM's routes (``POST /init_weight_transfer_engine`` with ``init_info``,
``POST /update_weights`` with ``update_info``: ``names``, ``dtype_names``, ``shapes``, ``packed``,
``packed_buffer_size_bytes``), with gymserve's ``weight_version``, ``pause_mode`` and ``timeout``
beside them; the group is ``engine.weight_transfer.Group`` (this process is rank 0 and hosts the
rendezvous). Each call runs its HTTP request in a thread while this thread joins the group or
broadcasts, since the server's side blocks in the same collective.

Errors: ``WeightSyncError`` carrying the server's error object (``status``, ``code``, ``message``)
when the server refuses or the transfer fails; then the old weights keep serving. A failed
broadcast leaves the group unusable: ``send`` closes it and the next ``send`` reopens one.
"""

from __future__ import annotations

import concurrent.futures as cf
import socket
import time
from collections.abc import Mapping
from typing import Any

from gymserve.engine.weight_transfer import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_GROUP,
    Group,
    bucket_layout,
    dtype_name,
    metadata_of,
)


class WeightSyncError(RuntimeError):
    """The server refused or a transfer failed: ``status`` (HTTP; 0 when the server never
    answered), ``code``, ``param`` and ``message`` from its error object."""

    def __init__(self, message: str, *, status: int = 0, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.code, self.param = message, status, code, param


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the rendezvous port, when none is given)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class WeightSender:
    """Rank 0 of a weight-transfer group with the gymserve at ``base_url`` (with or without
    ``/v1``). ``master_address``/``master_port``: where this process hosts the rendezvous (an
    address the server can reach; a free port by default); ``backend``: ``gloo`` (CPU tensors) or
    ``nccl`` (CUDA tensors on ``device``); ``timeout``: seconds the rendezvous, one broadcast and
    each HTTP call may take; ``bucket_bytes``: default bucket size for ``send`` (0: one broadcast
    per tensor); ``api_key``: the server's admin (or API) key; ``api``: whose routes to call,
    ``vllm`` (``/init_weight_transfer_engine``, ``/update_weights``) or ``sglang``
    (``/init_weights_update_group``, ``/update_weights_from_distributed``: one broadcast per tensor,
    and only ``pause_mode="abort"``, SGLang's ``abort_all_requests``)."""

    def __init__(
        self,
        base_url: str,
        *,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str = "gloo",
        group_name: str = DEFAULT_GROUP,
        timeout: float = 120.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        api_key: str | None = None,
        device: Any = None,
        api: str = "vllm",
    ):
        import httpx

        if api not in ("vllm", "sglang"):
            raise ValueError(f"api must be vllm or sglang, got {api!r}")
        self.api = api

        self.root = base_url.rstrip("/").removesuffix("/v1")
        self.master_address = master_address
        self.master_port = master_port
        self.backend, self.group_name, self.timeout = backend, group_name, timeout
        self.bucket_bytes = bucket_bytes
        self.device = device
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.root, headers=headers, timeout=timeout + 30)
        self.group: Group | None = None
        self._collective_pending = False
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gymserve-weight-sync")

    # ---- HTTP -----------------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post(path, json=body)
        if r.status_code >= 400:
            try:
                err = r.json().get("error") or {}
            except ValueError:
                err = {}
            raise WeightSyncError(
                f"{path}: {r.status_code} {err.get('message') or r.text}",
                status=r.status_code,
                code=err.get("code"),
                param=err.get("param"),
            )
        return r.json()

    def _alongside(self, path: str, body: dict[str, Any], collective) -> dict[str, Any]:
        """POST ``body`` to ``path`` in a thread while ``collective()`` runs here (the server's
        side of the route waits in the same collective). An HTTP error that arrives first is
        raised at once; the collective is then left to its own timeout."""
        fut = self._pool.submit(self._post, path, body)
        worker = cf.ThreadPoolExecutor(max_workers=1)
        done = worker.submit(collective)
        self._collective_pending = False
        try:
            finished, _ = cf.wait([fut, done], timeout=self.timeout + 30, return_when=cf.FIRST_COMPLETED)
            if fut in finished and fut.exception() is not None and not done.done():
                # The server answered without joining the collective: ours still waits in it, so
                # this group can never line up again (send drops it on both sides).
                self._collective_pending = True
                raise fut.exception()  # type: ignore[misc]
            done.result(timeout=self.timeout + 30)
            return fut.result(timeout=self.timeout + 30)
        finally:
            worker.shutdown(wait=False)

    # ---- the group ------------------------------------------------------------------------------
    def open(self) -> dict[str, Any]:
        """Join the server in a new group (``POST /init_weight_transfer_engine``); returns its
        answer (``group``: the server's description of it)."""
        if self.group is not None:
            return {"group": "open"}
        port = self.master_port or free_port(self.master_address)
        init_info = {
            "master_address": self.master_address,
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "backend": self.backend,
            "group_name": self.group_name,
            "timeout": self.timeout,
        }
        made: dict[str, Group] = {}

        def join() -> None:
            made["group"] = Group(
                self.master_address,
                port,
                0,
                2,
                backend=self.backend,
                group_name=self.group_name,
                timeout=self.timeout,
                device=self.device,
            )

        if self.api == "sglang":
            answer = self._alongside("/init_weights_update_group", init_info, join)
        else:
            answer = self._alongside("/init_weight_transfer_engine", {"init_info": init_info}, join)
        self.group = made["group"]
        return answer

    def send(
        self,
        tensors: Mapping[str, Any],
        *,
        weight_version: int | str | None = None,
        bucket_bytes: int | None = None,
        pause_mode: str | None = None,
    ) -> dict[str, Any]:
        """Broadcast ``tensors`` (name → tensor: a state dict or any part of it) and have the server
        swap them in; returns its answer (``weight_version``, ``seconds``, ``receive_seconds``,
        ``bytes``, ``broadcasts``) plus ``send_seconds`` measured here. ``pause_mode``: pause the
        server's generation in this mode (vLLM's ``abort``/``wait``/``keep``) around the swap.
        Raises ``WeightSyncError``."""
        import torch

        if self.group is None:
            self.open()
        group = self.group
        assert group is not None
        size = self.bucket_bytes if bucket_bytes is None else bucket_bytes
        named = {k: v.detach() for k, v in tensors.items()}
        metas = metadata_of(named)
        body: dict[str, Any] = {
            "update_info": {
                "names": [m.name for m in metas],
                "dtype_names": [dtype_name(m.dtype) for m in metas],
                "shapes": [list(m.shape) for m in metas],
                "packed": size > 0,
                **({"packed_buffer_size_bytes": size} if size > 0 else {}),
            }
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        if pause_mode is not None:
            body["pause_mode"] = pause_mode
        values = list(named.values())
        path = "/update_weights"
        if self.api == "sglang":
            if size > 0 or pause_mode not in (None, "abort"):
                raise ValueError(
                    "SGLang's route sends one tensor per broadcast (bucket_bytes=0) and pauses only in abort mode"
                )
            path = "/update_weights_from_distributed"
            body = {
                "names": body["update_info"]["names"],
                "dtypes": body["update_info"]["dtype_names"],
                "shapes": body["update_info"]["shapes"],
                "group_name": self.group_name,
                "abort_all_requests": pause_mode == "abort",
                **({"weight_version": weight_version} if weight_version is not None else {}),
            }

        def broadcast() -> None:
            for bucket in bucket_layout(metas, size):
                if size <= 0:
                    group.broadcast(values[bucket[0]].to(group.device).contiguous())
                else:
                    parts = [values[i].to(group.device).contiguous().reshape(-1).view(torch.uint8) for i in bucket]
                    group.broadcast(torch.cat(parts) if len(parts) > 1 else parts[0])  # the root only reads it

        t0 = time.perf_counter()
        try:
            answer = self._alongside(path, body, broadcast)
        except WeightSyncError:
            if self._collective_pending:
                self._abandon()
            elif not self._server_group_open():  # a refused tensor leaves the group usable; a failed transfer does not
                self._drop()
            raise
        except Exception:
            self._drop()
            raise
        answer["send_seconds"] = round(time.perf_counter() - t0, 6)
        return answer

    def _server_group_open(self) -> bool:
        """Whether the server still holds the group (``GET /weight_info``); False when it cannot say."""
        try:
            r = self.http.get("/weight_info")
            return r.status_code == 200 and (r.json().get("weight_transfer") or {}).get("group") is not None
        except Exception:  # noqa: BLE001 - unreachable or not JSON: treat the group as gone
            return False

    def _abandon(self) -> None:
        """Close the group here and on the server (``/destroy_weights_update_group``)."""
        try:
            self._post("/destroy_weights_update_group", {"group_name": self.group_name})
        except Exception:  # noqa: BLE001 - best effort: the next open replaces the server's group anyway
            pass
        self._drop()

    def _drop(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()

    def close(self) -> None:
        """Leave the group (``POST /destroy_weights_update_group``) and close the HTTP client."""
        if self.group is not None:
            try:
                self._post("/destroy_weights_update_group", {"group_name": self.group_name})
            except Exception:  # noqa: BLE001 - closing: the server may be gone already
                pass
            self._drop()
        self.http.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> WeightSender:
        self.open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
