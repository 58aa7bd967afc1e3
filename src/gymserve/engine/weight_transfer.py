"""Process-group weight transfer, the server's side: a trainer in its own process joins a
``torch.distributed`` group with this server and broadcasts named tensors; the server receives them
into staging buffers and hands them to the in-process weight swap (``update_weights(tensors)``,
``engine.control``), which validates every name, shape and dtype against the served model and
swaps all of them at once between two decode steps, or none.

The layout is vLLM's and SGLang's (their NCCL weight sync): the trainer is rank 0 and hosts the
rendezvous (a ``TCPStore`` at ``master_address:master_port``); the server's ranks are
``rank_offset`` … ``rank_offset + n - 1`` of ``world_size`` (gymserve's local engine is one rank).
The group is a ``ProcessGroupGloo`` (CPU tensors; what runs on any machine) or a
``ProcessGroupNCCL`` (CUDA tensors) made directly on a ``PrefixStore(group_name, store)``: it never
touches ``torch.distributed``'s default group, so a trainer's FSDP group and this one coexist.

One update: the trainer announces ``names``, ``dtype_names`` and ``shapes`` (over HTTP, vLLM's
``update_info``), then broadcasts the tensors from rank 0 in that order, grouped in buckets
(``bucket_layout``): with ``bucket_bytes`` 0 each tensor is one broadcast (vLLM's and SGLang's
default, ``packed: false``); otherwise consecutive tensors are packed byte for byte into one
``uint8`` buffer of at most ``bucket_bytes`` (a larger tensor travels alone), one broadcast per
buffer. Both sides compute the same layout from the announced metadata, so no sizes travel.

Failure rules: whatever the trainer announced is received in full before anything is checked
against the model (so a refused update never leaves the trainer blocked in a broadcast, and the
group stays usable); the swap then refuses a wrong name, shape or dtype with ``WeightUpdateError``
naming the tensor. A broadcast that fails (the trainer died, the connection dropped, ``timeout``
seconds passed) closes the group and raises ``WeightTransferError`` (code ``weight_transfer_failed``)
saying how far it got; nothing was swapped, so the old weights and version keep serving.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gymserve.errors import ConflictError, InvalidRequestError, WeightTransferError, WeightUpdateError

log = logging.getLogger("gymserve.engine")

BACKENDS = ("gloo", "nccl")
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
DEFAULT_TIMEOUT = 600.0  # seconds a rendezvous or one broadcast may take
DEFAULT_BUCKET_BYTES = 256 << 20  # trainer default: 256 MiB buffers (swept in bench/control.py)
# The dtypes a transfer may announce: torch's own names ("bfloat16"; SGLang and SkyRL may send "torch.bfloat16").
DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
)


@dataclass(frozen=True)
class TensorMeta:
    """One announced tensor: its state-dict ``name``, torch ``dtype`` and ``shape``."""

    name: str
    dtype: Any
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def dtype_of(name: Any, param: str = "dtype_names") -> Any:
    """The torch dtype called ``name`` (``"bfloat16"`` or ``"torch.bfloat16"``); else
    ``InvalidRequestError`` naming ``param`` and the dtypes accepted."""
    import torch

    bare = name.removeprefix("torch.") if isinstance(name, str) else None
    if bare not in DTYPE_NAMES:
        raise InvalidRequestError(f"{param}: unknown dtype {name!r}; use one of {', '.join(DTYPE_NAMES)}", param=param)
    return getattr(torch, bare)


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (what vLLM's ``dtype_names`` holds)."""
    return str(dtype).removeprefix("torch.")


def parse_metadata(
    names: Sequence[Any], dtypes: Sequence[Any], shapes: Sequence[Any], *, dtype_param: str = "dtype_names"
) -> list[TensorMeta]:
    """The announced tensors, checked for form only (lists of one length, known dtypes,
    non-negative integer shapes, no name twice). Raises ``InvalidRequestError`` naming the field."""
    if not names:
        raise InvalidRequestError("names is empty: a weight transfer must announce at least one tensor", param="names")
    for param, seq in ((dtype_param, dtypes), ("shapes", shapes)):
        if len(seq) != len(names):
            raise InvalidRequestError(
                f"{param} has {len(seq)} entries and names has {len(names)}; they must have one per tensor",
                param=param,
            )
    seen: set[str] = set()
    out = []
    for i, (name, dt, shape) in enumerate(zip(names, dtypes, shapes)):
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"names[{i}] must be a non-empty string, got {name!r}", param="names")
        if name in seen:
            raise InvalidRequestError(f"names[{i}]: tensor {name!r} is announced twice", param="names")
        seen.add(name)
        if not isinstance(shape, (list, tuple)) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise InvalidRequestError(
                f"shapes[{i}] must be a list of non-negative integers, got {shape!r}", param="shapes"
            )
        out.append(TensorMeta(name, dtype_of(dt, dtype_param), tuple(shape)))
    return out


def bucket_layout(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``metas`` per broadcast, in order: one tensor each for ``bucket_bytes`` 0,
    otherwise consecutive tensors while their bytes sum to at most ``bucket_bytes`` (a tensor
    larger than that alone). The trainer (``gymserve.trainer``) and the server both use this."""
    if bucket_bytes <= 0:
        return [[i] for i in range(len(metas))]
    out: list[list[int]] = []
    size = 0
    for i, m in enumerate(metas):
        if out and size + m.nbytes <= bucket_bytes:
            out[-1].append(i)
            size += m.nbytes
        else:
            out.append([i])
            size = m.nbytes
    return out


def local_address_toward(host: str) -> str:
    """The address of this machine's interface that reaches ``host`` (gloo binds its pairs there;
    ``host`` itself when it is this machine). No packet is sent: a UDP ``connect`` only routes."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return host


class Group:
    """One ``torch.distributed`` process group of ``world_size`` ranks, this process at ``rank``
    (rank 0 hosts the store). Blocks until every rank has joined or ``timeout`` seconds passed
    (then ``WeightTransferError``, 400, code ``weight_transfer_failed``). ``device``: where NCCL tensors
    live (``cuda:N``); gloo uses the CPU."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        group_name: str = DEFAULT_GROUP,
        timeout: float = DEFAULT_TIMEOUT,
        device: Any = None,
    ):
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise InvalidRequestError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}", param="backend")
        self.backend, self.group_name, self.rank, self.world_size = backend, group_name, rank, world_size
        self.master = f"{master_address}:{master_port}"
        self.timeout = timeout
        delta = timedelta(seconds=timeout)
        try:
            self.store: Any = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=delta)
            prefixed = dist.PrefixStore(group_name, self.store)
            if backend == "gloo":
                self.device = torch.device("cpu")
                opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                opts._timeout = delta
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_toward(master_address))]
                self.pg: Any = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
            else:
                if not torch.cuda.is_available():
                    raise InvalidRequestError(
                        "backend nccl needs a CUDA device and this process has none; use backend gloo",
                        param="backend",
                    )
                self.device = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
                nccl_opts = dist.ProcessGroupNCCL.Options()
                nccl_opts._timeout = delta
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, nccl_opts)
            # One tiny broadcast: the group is only known to work once every rank has exchanged data.
            self.broadcast(torch.zeros(1, device=self.device))
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - DistStoreError, RuntimeError from gloo/NCCL: the rendezvous failed
            raise WeightTransferError(
                f"could not form the weight-transfer group at {self.master} (rank {rank} of {world_size}, "
                f"{backend}, group {group_name!r}) within {timeout:g} s: {type(exc).__name__}: {exc}"
            ) from None

    def broadcast(self, tensor: Any, src: int = 0) -> None:
        """Broadcast ``tensor`` in place from rank ``src``; waits at most the group's timeout."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        """Drop the group and the store (a peer that died leaves nothing to say goodbye to)."""
        pg, self.pg = getattr(self, "pg", None), None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort: the peer may already be gone
                pass
        self.store = None


def receive(group: Group, metas: Sequence[TensorMeta], bucket_bytes: int) -> dict[str, Any]:
    """Receive the announced tensors from rank 0 (``bucket_layout``); ``{name: tensor}`` on the
    group's device, each a view of its bucket's staging buffer (no second copy). Raises
    ``WeightTransferError`` (code ``weight_transfer_failed``) when a broadcast fails."""
    import torch

    out: dict[str, Any] = {}
    layout = bucket_layout(metas, bucket_bytes)
    done = 0
    try:
        for n, bucket in enumerate(layout):
            if bucket_bytes <= 0:
                m = metas[bucket[0]]
                t = torch.empty(m.shape, dtype=m.dtype, device=group.device)
                group.broadcast(t)
                out[m.name] = t
            else:
                buf = torch.empty(sum(metas[i].nbytes for i in bucket), dtype=torch.uint8, device=group.device)
                group.broadcast(buf)
                off = 0
                for i in bucket:
                    m = metas[i]
                    out[m.name] = buf[off : off + m.nbytes].view(m.dtype).view(m.shape)
                    off += m.nbytes
            done = n + 1
    except Exception as exc:  # noqa: BLE001 - gloo/NCCL errors are RuntimeErrors of many kinds
        raise WeightTransferError(
            f"weight transfer failed after {done} of {len(layout)} broadcasts ({len(out)} of {len(metas)} "
            f"tensors) from {group.master}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; "
            "nothing changed, the old weights keep serving. The group is closed: open a new one"
        ) from None
    return out


@dataclass
class TransferState:
    """What ``/weight_info`` and ``/health`` show of the transfer (``WeightReceiver.status``)."""

    group: dict[str, Any] | None = None
    transfers: int = 0
    failures: int = 0
    last_error: str | None = None
    last_seconds: float | None = None
    last_bytes: int | None = None
    in_progress: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class WeightReceiver:
    """The server's end of process-group weight transfer over ``target`` (a backend or engine with
    ``update_weights(tensors, weight_version=)``, ``pause_generation`` and ``resume_generation``).
    At most one group at a time, one update at a time. ``ranks``: how many ranks this server takes
    in the group (1: the local engine receives once and swaps; a fleet would fan out)."""

    def __init__(self, target: Any, *, device: Any = None, ranks: int = 1):
        self.target = target
        self.device = device
        self.ranks = ranks
        self.group: Group | None = None
        self.state = TransferState()
        self._lock = asyncio.Lock()
        self._close_lock = threading.Lock()

    async def init(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        backend: str = "gloo",
        group_name: str = DEFAULT_GROUP,
        timeout: float = DEFAULT_TIMEOUT,
        override_existing: bool = True,
    ) -> dict[str, Any]:
        """Join the trainer's group as rank ``rank_offset`` (blocks until the trainer has joined, at
        most ``timeout`` s). A group already open is closed first when ``override_existing``
        (SkyRL's flag; vLLM and SGLang replace it), else ``ConflictError`` (409). Returns the
        group's description (as ``status()["group"]``)."""
        if not 0 < rank_offset < world_size or rank_offset + self.ranks > world_size:
            raise InvalidRequestError(
                f"rank_offset {rank_offset} with world_size {world_size}: this server takes {self.ranks} rank(s) "
                "after the trainer's rank 0, so 1 <= rank_offset <= world_size - "
                f"{self.ranks}",
                param="rank_offset",
            )
        if not 0 < master_port < 65536:
            raise InvalidRequestError(f"master_port must be 1..65535, got {master_port}", param="master_port")
        async with self._lock:
            if self.group is not None:
                if not override_existing:
                    raise ConflictError(
                        f"a weight-transfer group is already open ({self.state.group}); destroy it first or "
                        "send override_existing: true",
                        code="weight_transfer_group_open",
                    )
                await asyncio.to_thread(self._close)
            t0 = time.perf_counter()
            try:
                self.group = await asyncio.to_thread(
                    Group,
                    master_address,
                    master_port,
                    rank_offset,
                    world_size,
                    backend=backend,
                    group_name=group_name,
                    timeout=timeout,
                    device=self.device,
                )
            except WeightTransferError as exc:
                self._failed(exc.message)
                raise
            self.state.group = {
                "backend": backend,
                "group_name": group_name,
                "master": f"{master_address}:{master_port}",
                "rank": rank_offset,
                "world_size": world_size,
                "timeout": timeout,
                "init_seconds": round(time.perf_counter() - t0, 6),
            }
            log.info("weight-transfer group open: %s", self.state.group)
            return dict(self.state.group)

    async def update(
        self,
        metas: Sequence[TensorMeta],
        *,
        bucket_bytes: int = 0,
        weight_version: Any = None,
        pause_mode: str | None = None,
    ) -> dict[str, Any]:
        """Receive ``metas`` from the trainer (``receive``), then swap them in through
        ``target.update_weights`` — under a pause in ``pause_mode`` (vLLM's modes; None: no pause,
        in-flight calls continue on the new weights from their next step) that ends when the swap
        does. Returns ``{"weight_version", "seconds", "receive_seconds", "bytes", "broadcasts"}``.
        Raises ``ConflictError`` (409) without a group, ``WeightUpdateError`` when the transfer
        fails (the group is then closed) or the swap refuses a tensor (the group stays open);
        either way the old weights keep serving."""
        async with self._lock:
            group = self.group
            if group is None:
                raise ConflictError(
                    "no weight-transfer group is open: POST /init_weight_transfer_engine (vLLM) or "
                    "/init_weights_update_group (SGLang) first",
                    code="no_weight_transfer_group",
                )
            self.state.in_progress = True
            t0 = time.perf_counter()
            try:
                try:
                    tensors = await asyncio.to_thread(receive, group, metas, bucket_bytes)
                except WeightTransferError as exc:
                    await asyncio.to_thread(self._close)
                    self._failed(exc.message)
                    raise
                received = time.perf_counter()
                paused = False
                try:
                    if pause_mode is not None:
                        await self.target.pause_generation(pause_mode)
                        paused = True
                    version = await self.target.update_weights(tensors, weight_version=weight_version)
                except WeightUpdateError as exc:
                    self._failed(exc.message)
                    raise
                finally:
                    if paused:
                        await self.target.resume_generation()
                    del tensors
            finally:
                self.state.in_progress = False
            seconds = time.perf_counter() - t0
            nbytes = sum(m.nbytes for m in metas)
            self.state.transfers += 1
            self.state.last_error = None
            self.state.last_seconds = round(seconds, 6)
            self.state.last_bytes = nbytes
            return {
                "weight_version": version,
                "seconds": round(seconds, 6),
                "receive_seconds": round(received - t0, 6),
                "bytes": nbytes,
                "broadcasts": len(bucket_layout(metas, bucket_bytes)),
            }

    def _failed(self, message: str) -> None:
        self.state.failures += 1
        self.state.last_error = message
        log.warning("weight transfer refused or failed: %s", message)

    def _close(self) -> None:
        with self._close_lock:
            group, self.group = self.group, None
            self.state.group = None
            if group is not None:
                group.close()

    async def destroy(self) -> bool:
        """Close the group; whether one was open. Waits for an update in progress to end."""
        async with self._lock:
            was = self.group is not None
            await asyncio.to_thread(self._close)
            return was

    def status(self) -> dict[str, Any]:
        """``{"group": {...} | None, "transfers", "failures", "last_error", "last_seconds",
        "last_bytes", "in_progress"}``."""
        s = self.state
        return {
            "group": s.group,
            "transfers": s.transfers,
            "failures": s.failures,
            "last_error": s.last_error,
            "last_seconds": s.last_seconds,
            "last_bytes": s.last_bytes,
            "in_progress": s.in_progress,
        }


def metadata_of(tensors: Mapping[str, Any]) -> list[TensorMeta]:
    """The ``TensorMeta`` of each named tensor, in order (the trainer's announcement)."""
    return [TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
