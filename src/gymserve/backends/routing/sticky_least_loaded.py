"""``sticky-least-loaded`` (the default): a new session goes to the least-loaded replica and stays.

What prime-rl (PR #3563, via vllm-router's ``sticky_least_loaded``) and SkyRL default to for RL
rollouts: a multi-turn rollout re-sends a growing prefix every turn, and an engine's prefix (KV)
cache helps only when the next turn lands where the last one was computed.

- **Placement** (a new session, a session that must move, a call without a session): the eligible
  replica with the fewest calls in flight from this front end (the join-the-shortest-queue signal
  of Envoy's ``LEAST_REQUEST`` and SGLang's router; a slow replica keeps its calls longer, so it
  looks busier and gets fewer new sessions); among equals the one with the fewest active sessions
  (so a burst of sessions arriving together spreads evenly before any call is in flight); among
  equals the next in rotation.
- **Stickiness**: a session's turn stays on its replica while that replica is eligible and not far
  more loaded than the least-loaded one — it moves only when both
  ``in_flight(home) − in_flight(least) ≥ rebalance_min_gap`` and
  ``in_flight(home) ≥ rebalance_ratio × in_flight(least)`` (the two-threshold test SGLang's router
  uses to call a fleet imbalanced: ``balance_abs_threshold`` and ``balance_rel_threshold``). A move
  costs the session one cold prefill on its new replica, so the thresholds are wide by default.

Cost per call: O(1) while a session stays (the imbalance scan runs only once its replica has
``rebalance_min_gap`` calls in flight), O(replicas) to place one.
"""

from __future__ import annotations

from collections.abc import Sequence

from gymserve.backends.routing.base import Eligible, R, Rotation, RoutingPolicy


class StickyLeastLoaded(RoutingPolicy[R]):
    """Sessions placed on the least-loaded replica and kept there (see the module docstring)."""

    name = "sticky-least-loaded"

    def __init__(self, replicas: Sequence[R], config: object):
        super().__init__(replicas, config)
        self.ratio = float(getattr(config, "rebalance_ratio", 2.0))
        self.min_gap = int(getattr(config, "rebalance_min_gap", 8))
        self._rotation = Rotation(replicas)

    def stay(self, home: R, eligible: Eligible) -> bool:
        if home.in_flight < self.min_gap:  # cannot be min_gap above anyone
            return True
        least = self._least(eligible)
        if least is None or least is home:
            return True
        gap = home.in_flight - least.in_flight
        return not (gap >= self.min_gap and home.in_flight >= self.ratio * least.in_flight)

    def place(self, eligible: Eligible, session_id: str | None) -> R | None:
        return self._least(eligible, rotate=True)

    def _least(self, eligible: Eligible, *, rotate: bool = False) -> R | None:
        # The load comparison comes first and is two attribute reads: eligibility (a call) is checked
        # only for a replica that would win, which keeps a scan of hundreds of replicas in the tens of µs.
        start = self._rotation.start % len(self.replicas)
        best: R | None = None
        best_flight = best_active = best_i = 0
        for i, r in enumerate(self.replicas[start:] + self.replicas[:start]):
            flight = r.in_flight
            if best is not None and (
                flight > best_flight or (flight == best_flight and r.active_sessions >= best_active)
            ):
                continue
            if not eligible(r):
                continue
            best, best_flight, best_active, best_i = r, flight, r.active_sessions, i
            if flight == 0 and best_active == 0:
                break  # nothing beats an idle replica
        if best is not None and rotate:
            self._rotation.taken((start + best_i) % len(self.replicas))
        return best
