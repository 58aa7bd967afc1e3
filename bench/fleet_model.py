"""The simulated fleet under ``bench/fleet.py``: a virtual-time event loop and engine replicas that
model a prefix cache, driven through gymserve's real chat backend and router.

- ``VirtualTimeLoop``: an asyncio loop whose clock jumps to the next timer instead of waiting for
  it (its selector does no I/O: ``select(timeout)`` advances the clock by ``timeout``). Everything
  that waits on ``asyncio.sleep``, ``asyncio.timeout`` or ``loop.time()`` — the replicas below,
  the sessions' tool calls, and gymserve's router (backoffs, breaker cool-downs, retry-budget
  windows, health probes: ``pool.loop_time``) — runs on simulated seconds, so a run is
  deterministic for a seed, independent of the machine's load, and as fast as the Python code.
- ``SimReplica``: one engine with continuous batching. Each step decodes ``step_tokens`` tokens
  for every running call whose prompt is computed, and prefills up to ``chunk_tokens`` uncached
  prompt tokens (chunked prefill); a step lasts ``step_tokens × decode_step_s`` (when anything
  decodes) + ``prefilled / prefill_tok_s``, times the replica's slow-down factor. Prefill shares
  the step with decoding, so every cache miss slows every call on the replica, as in vLLM and
  SGLang. The prefix cache holds, per session, the tokens of its last finished call (prompt +
  generation), least recently used evicted beyond ``cache_tokens``; the shared system prompt stays
  cached once served. A prompt's hit is its longest cached prefix: the session's entry (gymserve
  keeps turns token-contiguous, so an entry is always a prefix of the next prompt) or the system
  prompt. ``kill()`` fails what it holds with a reset connection and refuses new ones; ``slow``
  multiplies its step time.
- ``SimTransport``: what ``caller.UpstreamCaller`` calls for a replica (``upstream.Transport``'s
  ``post``/``get``): a chat completion with ``usage``, the session read from the forwarded
  ``X-Session-ID``; ``SimUpstream``: the chat backend's upstream with these transports.
"""

from __future__ import annotations

import asyncio
import selectors
import types
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from gymserve.backends.chat import ChatBackend, ChatUpstream
from gymserve.backends.upstream import Transport


# ------------------------------------------------------------------------------ virtual time
class _NoIOSelector(selectors.BaseSelector):
    """Keeps registrations (the loop's self-pipe) but never polls: waiting is advancing the clock."""

    def __init__(self) -> None:
        self._keys: dict[int, selectors.SelectorKey] = {}
        self.loop: VirtualTimeLoop | None = None

    def register(self, fileobj, events, data=None):
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fd] = key
        return key

    def unregister(self, fileobj):
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._keys.pop(fd)

    def select(self, timeout=None):
        if timeout is None:
            raise RuntimeError("the simulation is deadlocked: nothing is ready and no timer is set")
        assert self.loop is not None
        self.loop.advance(timeout)
        return []

    def get_map(self):
        return types.MappingProxyType(self._keys)

    def close(self) -> None:
        self._keys.clear()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on simulated time (see the module docstring); no sockets, no threads."""

    def __init__(self) -> None:
        self._now = 0.0
        selector = _NoIOSelector()
        super().__init__(selector)
        selector.loop = self

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)


# ------------------------------------------------------------------------------ replicas
@dataclass
class EngineModel:
    """One replica's speed and memory (simulated seconds and tokens)."""

    decode_step_s: float = 0.025  # one decode step of the whole batch
    prefill_tok_s: float = 8000.0  # uncached prompt tokens computed per second
    chunk_tokens: int = 2048  # prefill tokens per step (chunked prefill)
    step_tokens: int = 5  # tokens decoded per simulated step (coarser steps, same rates)
    max_batch: int = 64  # calls running at once; the rest wait
    cache_tokens: int = 120_000  # prefix-cache capacity (KV blocks of finished calls)
    system_prompt: int = 1500  # tokens every session's prompt starts with (cached once served)


@dataclass(eq=False)
class _Call:
    session: str
    prompt: int
    gen: int
    future: asyncio.Future
    prefill_left: int = 0
    generated: int = 0


@dataclass
class ReplicaCounters:
    prompt_tokens: int = 0
    hit_tokens: int = 0
    calls: int = 0
    generated: int = 0
    queue_area: float = 0.0  # integral of calls held (waiting + running) over simulated time
    evicted: int = 0


class SimReplica:
    """One simulated engine (see the module docstring)."""

    def __init__(self, name: str, model: EngineModel):
        self.name, self.model = name, model
        self.cache: OrderedDict[str, int] = OrderedDict()
        self.cached = 0
        self.system_cached = False
        self.waiting: deque[_Call] = deque()
        self.running: list[_Call] = []
        self.alive = True
        self.slow = 1.0
        self.counters = ReplicaCounters()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._engine(), name=f"sim-{self.name}")

    async def submit(self, session: str, prompt: int, gen: int) -> dict[str, Any]:
        if not self.alive:
            raise ConnectionRefusedError(111, "Connection refused")
        call = _Call(session, prompt, gen, asyncio.get_running_loop().create_future())
        self.waiting.append(call)
        self._wake.set()
        return await call.future

    async def stop(self) -> None:
        """Kill it and end its engine task."""
        self.kill()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def kill(self) -> None:
        self.alive = False
        for call in [*self.waiting, *self.running]:
            if not call.future.done():
                call.future.set_exception(ConnectionResetError(104, "Connection reset by peer"))
        self.waiting.clear()
        self.running.clear()
        self.cache.clear()
        self._wake.set()

    def _admit(self, call: _Call) -> None:
        m, c = self.model, self.counters
        hit = 0
        if call.session in self.cache:
            hit = min(self.cache[call.session], call.prompt)
            self.cache.move_to_end(call.session)
        if self.system_cached:
            hit = max(hit, min(m.system_prompt, call.prompt))
        call.prefill_left = call.prompt - hit
        c.prompt_tokens += call.prompt
        c.hit_tokens += hit
        self.running.append(call)

    def _finish(self, call: _Call) -> None:
        m, c = self.model, self.counters
        c.calls += 1
        c.generated += call.gen
        self.system_cached = True
        self.cached -= self.cache.pop(call.session, 0)
        self.cache[call.session] = call.prompt + call.gen
        self.cached += call.prompt + call.gen
        while self.cached > m.cache_tokens and self.cache:
            _, tokens = self.cache.popitem(last=False)
            self.cached -= tokens
            c.evicted += 1
        if not call.future.done():
            call.future.set_result(
                {
                    "id": "chatcmpl-sim",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "sim",
                    "choices": [
                        {"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "…"}}
                    ],
                    "usage": {
                        "prompt_tokens": call.prompt,
                        "completion_tokens": call.gen,
                        "total_tokens": call.prompt + call.gen,
                    },
                }
            )

    async def _engine(self) -> None:
        m = self.model
        while self.alive:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            while self.waiting and len(self.running) < m.max_batch:
                self._admit(self.waiting.popleft())
            decoding = [c for c in self.running if c.prefill_left == 0]
            budget = m.chunk_tokens
            for c in self.running:
                if budget <= 0:
                    break
                take = min(c.prefill_left, budget)
                c.prefill_left -= take
                budget -= take
            prefilled = m.chunk_tokens - budget
            step = ((m.step_tokens * m.decode_step_s) if decoding else 0.0) + prefilled / m.prefill_tok_s
            step *= self.slow
            held = len(self.waiting) + len(self.running)
            await asyncio.sleep(step)
            if not self.alive:
                return
            self.counters.queue_area += held * step
            for c in decoding:
                c.generated += m.step_tokens
                if c.generated >= c.gen:
                    self.running.remove(c)
                    self._finish(c)


class SimTransport(Transport):
    """A replica's HTTP stack as ``caller.UpstreamCaller`` uses it, answered by a ``SimReplica``."""

    def __init__(self, replica: SimReplica):
        super().__init__(sdk=None)
        self.replica = replica

    async def post(self, url: str, body: dict[str, Any], *, headers: dict[str, str] | None = None) -> Any:
        session = (headers or {}).get("X-Session-ID") or "-"
        return await self.replica.submit(session, int(body["sim_prompt_tokens"]), int(body["max_tokens"]))

    async def get(self, url: str, *, timeout: float | None = None) -> Any:
        if not self.replica.alive:
            raise ConnectionRefusedError(111, "Connection refused")
        return {"object": "list", "data": [{"id": "sim", "object": "model"}]}

    async def stream(self, url: str, body: dict[str, Any], *, headers: dict[str, str] | None = None) -> Any:
        raise NotImplementedError("the simulated fleet answers plain chat completions only")

    async def close(self) -> None:
        return None


class SimUpstream(ChatUpstream):
    """The chat backend's upstream with simulated replicas behind its base URLs."""

    def __init__(self, config: Any, replicas: dict[str, SimReplica]):
        super().__init__(config)
        self.replicas = replicas

    def transport(self, base: str) -> Transport:
        return SimTransport(self.replicas[base])


def sim_backend(config: Any, replicas: list[SimReplica]) -> ChatBackend:
    """gymserve's real chat backend (``RemoteBackend`` → ``UpstreamCaller`` → ``ReplicaPool``) over
    ``replicas``; ``config`` is a ``ChatBackendConfig`` whose ``base_urls`` name them in order."""
    upstream = SimUpstream(config, dict(zip(config.base_urls, replicas)))
    return ChatBackend(upstream, max_queue=1 << 20)
