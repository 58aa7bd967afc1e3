"""The weight version on every answer of the chat gateway (``protocol.VERSION_FIELDS``).

A trainer's servers behind the chat backend say which weights generated an answer in one of these
ways, and the gateway takes the first that is there, per choice:

1. **the server's own fields** — another gymserve puts ``weight_version`` (and
   ``weight_version_spans`` when a ``keep`` pause let an update land mid-generation) on the chat
   message, on the finish chunk's delta and on each completions choice, as the local backend does;
   they pass through untouched;
2. **SGLang's** — its OpenAI-compatible server puts ``metadata: {"weight_version": v}`` on a whole
   ``ChatCompletion`` and ``Completion`` (``ChatCompletionResponse.metadata`` /
   ``CompletionResponse.metadata`` in ``python/sglang/srt/entrypoints/openai/protocol.py``, filled
   from the generation's ``meta_info["weight_version"]`` in ``serving_chat.py`` /
   ``serving_completions.py``), and the generation's whole ``meta_info`` (``weight_version``
   included) on each choice with ``return_meta_info: true``. Its streamed chunks carry neither
   (``ChatCompletionStreamResponse`` has no ``metadata``, and ``return_meta_info`` is refused with
   ``stream: true``); its native ``/generate`` has ``meta_info.weight_version``, which the chat
   backend does not call;
3. **the gateway's stamp** — vLLM's OpenAI server names no version in its answers (only ``GET
   /weight_info`` says what serves now), so the gateway stamps what it knows
   (:class:`ReplicaVersions`): the version of the replica that answered — the one it forwarded to
   that replica last, or read from its ``/weight_info`` (vLLM) / ``/model_info`` (SGLang) — but
   only when no weight change (update, rename, LoRA load or unload) was forwarded to the servers
   while the call ran. A call that overlapped one gets ``weight_version: null`` (its tokens may
   come from either version, and the gateway cannot tell where they part), an INFO log line and a
   count in ``/metrics`` (``gymserve_version_overlaps_total``), never a wrong version.

Unknown is ``null`` too: without ``backend.upstream_control`` the gateway forwards nothing and reads
nothing, and a server that reports no version (vLLM before its first ``/finish_weight_update``)
answers null. The fields sit where the local backend puts them: on ``choices[i].message`` (whole),
on each choice's finish chunk ``delta`` (streamed) and on each completions choice; the Responses and
Messages APIs over the chat backend take them from there (``convert``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gymserve.errors import GymserveError
from gymserve.redaction import redact_url

log = logging.getLogger("gymserve.backends")

VERSION = "weight_version"
READ_TIMEOUT = 5.0  # seconds a call waits for the servers' versions before it goes on without them
READ_INTERVAL = 10.0  # seconds between reads a call triggers while a version is unknown


def root_of(base_url: str) -> str:
    """A replica's server root: its base URL without a trailing ``/`` and ``/v1`` (where vLLM and
    SGLang serve their control endpoints)."""
    return base_url.rstrip("/").removesuffix("/v1")


class ReplicaVersions:
    """What the gateway knows of each replica's weight version, and when it changed.

    ``roots``: one server root per replica (:func:`root_of`); ``read``: an async callable returning
    ``{root: version}`` as the servers report it (``UpstreamControl.weight_versions``), or None when
    nothing can be read. ``epoch`` counts every change: the start and the end of each forwarded
    weight change (:meth:`changing`) and each version a read found different. A call's
    :class:`VersionWatch` compares the epoch at its start and end.
    """

    def __init__(self, roots: list[str], read: Callable[[], Awaitable[dict[str, Any]]] | None = None):
        self.versions: dict[str, Any] = {root: None for root in roots}
        self.overlaps: dict[str, int] = {root: 0 for root in roots}
        self.epoch = 0
        self.changes_in_flight = 0
        self._read = read
        self._next_read = 0.0
        self._lock: asyncio.Lock | None = None

    # ---- what changes the versions ----------------------------------------------------------------

    def observe(self, versions: dict[str, Any]) -> None:
        """Versions the servers reported (``{root: version}``); a changed one moves the epoch."""
        for root, version in versions.items():
            if root in self.versions and self.versions[root] != version:
                self.versions[root] = version
                self.epoch += 1

    def forget(self, root: str) -> None:
        """``root``'s version is unknown from now on (the replica came back from being unhealthy: a
        restarted server serves its startup weights, vLLM's ``"default"``); the next call reads it."""
        if root in self.versions:
            self.observe({root: None})
            self._next_read = 0.0

    def set_all(self, version: Any) -> None:
        """Every replica now serves ``version`` (a change forwarded to all of them took effect)."""
        self.observe(dict.fromkeys(self.versions, version))

    @contextlib.asynccontextmanager
    async def changing(self) -> AsyncIterator[None]:
        """Around a weight change forwarded to the servers: calls running at any time inside it get
        no version. A change that fails may have taken effect on some replicas, so every version
        becomes unknown and is read back from the servers at once (if that read fails too, the next
        call reads it)."""
        self.changes_in_flight += 1
        self.epoch += 1
        try:
            yield
        except BaseException:
            self.observe(dict.fromkeys(self.versions))
            self._next_read = 0.0
            await self.refresh()
            self._next_read = 0.0  # a read that failed too is tried again by the next call
            raise
        finally:
            self.changes_in_flight -= 1
            self.epoch += 1

    async def refresh(self, *, force: bool = False) -> None:
        """Read the servers' versions (best effort: a failure is logged and keeps what was known).
        Without ``force`` only when one is unknown and ``READ_INTERVAL`` passed since the last read;
        concurrent callers share one read."""
        if self._read is None:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not force and not self._wants_read():
                return  # known, or another call just read it
            self._next_read = time.monotonic() + READ_INTERVAL
            try:
                async with asyncio.timeout(None if force else READ_TIMEOUT):
                    versions = await self._read()
            except (GymserveError, TimeoutError) as exc:
                why = getattr(exc, "message", None) or f"no answer within {READ_TIMEOUT:g} s"
                log.info("could not read the servers' weight versions: %s", why)
                return
            self.observe(versions)

    def _wants_read(self) -> bool:
        return any(v is None for v in self.versions.values()) and time.monotonic() >= self._next_read

    # ---- what calls see -------------------------------------------------------------------------

    async def watch(self) -> VersionWatch:
        """A call's view, taken once it is admitted and about to go to a server (reading the
        servers' versions first while one is unknown, at most every ``READ_INTERVAL`` s)."""
        # The clock first: it is what keeps every call but one in ten seconds from scanning the
        # versions (a cost every gateway call paid, issue #30).
        if self._read is not None and time.monotonic() >= self._next_read and self._wants_read():
            await self.refresh()
        return VersionWatch(self, self.epoch, self.changes_in_flight > 0)

    def common(self) -> Any:
        """The version every replica serves, or None when they differ or one is unknown."""
        values = list(self.versions.values())
        return values[0] if values and all(v == values[0] for v in values) else None


class VersionWatch:
    """One call's view of :class:`ReplicaVersions`: the epoch when it started and whether a change
    was being forwarded then. :meth:`version` is asked when the answer (or a choice's last chunk)
    is in."""

    def __init__(self, book: ReplicaVersions, epoch: int, changing: bool):
        self.book, self.epoch, self.changing = book, epoch, changing
        self._counted = False

    def version(self, root: str | None) -> Any:
        """The version of ``root`` (None: the replica is not known, e.g. a call ended at the gateway
        before any answered; then the version all replicas share), or None when a weight change was
        forwarded while the call ran (logged and counted once per call) or the version is unknown."""
        book = self.book
        if self.changing or book.epoch != self.epoch:
            if not self._counted:
                self._counted = True
                if root in book.overlaps:
                    book.overlaps[root] += 1
                log.info(
                    "an answer from %s overlapped a weight change forwarded to the servers; it carries "
                    "weight_version null (its tokens may come from either version)",
                    redact_url(root) if root else "the servers",
                )
            return None
        return book.versions.get(root) if root is not None else book.common()

    def stamp(self, target: dict[str, Any], root: str | None, *named_by: Any) -> None:
        """Set ``target["weight_version"]`` unless the server put it there (a gymserve upstream, its
        spans riding along): the first version SGLang named in ``named_by`` (choice ``meta_info``,
        completion ``metadata``), else :meth:`version`."""
        if VERSION in target:
            return
        named = sglang_version(*named_by)
        target[VERSION] = named if named is not None else self.version(root)


def sglang_version(*holders: Any) -> Any:
    """The first ``weight_version`` in the ``meta_info`` / ``metadata`` objects of ``holders``
    (SGLang's places for it on a choice and a whole answer; see the module docstring)."""
    for holder in holders:
        if not isinstance(holder, dict):
            continue
        for key in ("meta_info", "metadata"):
            info = holder.get(key)
            if isinstance(info, dict) and info.get(VERSION) is not None:
                return info[VERSION]
    return None


def stamp_choices(watch: VersionWatch | None, answer: dict[str, Any], root: str | None, *, on: str | None) -> None:
    """Stamp each choice of a whole ``answer``: on ``choice[on]`` (``"message"`` for chat) or on the
    choice itself (``on=None``: a completions choice). Nothing without a ``watch``."""
    if watch is None:
        return
    for choice in answer.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        target = choice.get(on) if on is not None else choice
        if isinstance(target, dict):
            watch.stamp(target, root, choice, answer)


class StreamStamp:
    """Stamps a stream's choices: ``StreamStamp(watch, root, on=...)``, then :meth:`see` on every
    chunk in order. A choice is stamped on the chunk that finishes it (the one with its
    ``finish_reason``) — on its ``delta`` (``on="delta"``, chat) or on the choice itself (``on=None``,
    completions) — unless an earlier chunk of that choice already named its version (the server's
    own). Nothing without a ``watch``."""

    def __init__(self, watch: VersionWatch | None, root: str | None, *, on: str | None):
        self.watch, self.root, self.on = watch, root, on
        self._named: set[Any] = set()

    def see(self, chunk: dict[str, Any]) -> None:
        if self.watch is None:
            return
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            target = choice.get(self.on) if self.on is not None else choice
            if isinstance(target, dict) and VERSION in target:
                self._named.add(index)
            if choice.get("finish_reason") and index not in self._named:
                target = choice.setdefault(self.on, {}) if self.on is not None else choice
                if isinstance(target, dict):
                    self.watch.stamp(target, self.root, choice, chunk)
