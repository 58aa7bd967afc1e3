"""``SessionTable``: which replica each session lives on, which sessions are active, and how much of
each turn's prompt the replica should already hold in its prefix cache.

- **Affinity**: session ID → its replica (the one its last turn was routed to), least recently used
  forgotten beyond ``max_sessions``. ``Replica.sessions`` counts the entries per replica.
- **Active sessions**: a session counts toward its replica's ``active_sessions`` until
  ``idle_timeout`` seconds pass without a call (a rollout waiting on a slow tool is still active; one
  that ended stops counting). The sticky-least-loaded policy breaks ties with it.
- **Prefix-hit estimate**: gymserve keeps a rollout token-contiguous (turn k's prompt starts with
  turn k−1's prompt + generation), so when turn k lands on the replica that answered turn k−1, that
  replica has computed ``prompt_tokens + completion_tokens`` of turn k−1, all a prefix of turn k's
  prompt. The estimate credits exactly that (the ``usage`` of the answers), per replica:
  ``estimated_cached_tokens / prompt_tokens``. It ignores prefixes shared across sessions (a common
  system prompt: the real hit rate is higher) and evictions (lower); the engine's own counter (vLLM's
  ``vllm:prefix_cache_hits``/``vllm:prefix_cache_queries``) is the measurement, this is what the
  router can know.

Every operation is O(1) amortised (two ``OrderedDict``\\ s in last-use order).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gymserve.backends.pool import Replica


@dataclass(slots=True, eq=False)
class _Session:
    replica: Any  # the Replica its turns go to
    last_seen: float
    active: bool = False
    answered_by: Any = None  # the Replica that answered its last turn
    context_tokens: int = 0  # prompt + completion tokens of that turn


class SessionTable:
    """Session → replica, bounded (see the module docstring). ``moves`` counts sessions re-homed."""

    def __init__(self, *, max_sessions: int = 100_000, idle_timeout: float = 300.0):
        if max_sessions < 1 or idle_timeout <= 0:
            raise ValueError("a session table needs max_sessions >= 1 and idle_timeout > 0")
        self.max_sessions = max_sessions
        self.idle_timeout = idle_timeout
        self._all: OrderedDict[str, _Session] = OrderedDict()
        self._active: OrderedDict[str, _Session] = OrderedDict()
        self.moves = 0

    def __len__(self) -> int:
        return len(self._all)

    @property
    def active(self) -> int:
        """Sessions seen within ``idle_timeout`` (as of the last ``expire``)."""
        return len(self._active)

    def home(self, session_id: str) -> Replica | None:
        """The replica the session's last turn was routed to (None for a new or forgotten session)."""
        entry = self._all.get(session_id)
        return entry.replica if entry is not None else None

    def expire(self, now: float) -> None:
        """Stop counting sessions idle for ``idle_timeout`` seconds as active."""
        cutoff = now - self.idle_timeout
        while self._active:
            session_id, entry = next(iter(self._active.items()))
            if entry.last_seen >= cutoff:
                break
            del self._active[session_id]
            entry.active = False
            entry.replica.active_sessions -= 1

    def route(self, session_id: str, replica: Replica, now: float) -> bool:
        """Record that the session's turn goes to ``replica``; True when that moves the session."""
        entry = self._all.get(session_id)
        moved = False
        if entry is None:
            entry = self._all[session_id] = _Session(replica, now)
            replica.sessions += 1
            if len(self._all) > self.max_sessions:
                self._forget_oldest()
        else:
            self._all.move_to_end(session_id)
            if entry.replica is not replica:
                moved = True
                self.moves += 1
                entry.replica.sessions -= 1
                replica.sessions += 1
                if entry.active:
                    entry.replica.active_sessions -= 1
                    replica.active_sessions += 1
                entry.replica = replica
        entry.last_seen = now
        if entry.active:
            self._active.move_to_end(session_id)
        else:
            entry.active = True
            self._active[session_id] = entry
            replica.active_sessions += 1
        return moved

    def answered(self, session_id: str, replica: Replica, prompt_tokens: int, completion_tokens: int) -> None:
        """The session's turn was answered by ``replica`` with this ``usage``: update the replica's
        prefix-hit estimate and affinity counts (``Replica.stats``)."""
        entry = self._all.get(session_id)
        if entry is None:
            return
        stats = replica.stats
        cached = 0
        if entry.answered_by is not None:  # a later turn: its prefix was computed somewhere
            stats.later_turns += 1
            if entry.answered_by is replica:
                stats.affinity_hits += 1
                cached = min(entry.context_tokens, prompt_tokens)
        stats.prompt_tokens += prompt_tokens
        stats.estimated_cached_tokens += cached
        entry.answered_by = replica
        entry.context_tokens = prompt_tokens + completion_tokens

    def _forget_oldest(self) -> None:
        session_id, entry = self._all.popitem(last=False)
        entry.replica.sessions -= 1
        if entry.active:
            del self._active[session_id]
            entry.replica.active_sessions -= 1
