"""The session table: affinity, active sessions, bounds, and the prefix-hit estimate."""

from __future__ import annotations

from gymserve.backends.pool import Replica
from gymserve.backends.routing.sessions import SessionTable


def test_route_counts_sessions_and_moves():
    a, b = Replica("http://a/v1"), Replica("http://b/v1")
    t = SessionTable(idle_timeout=60)
    assert t.route("s1", a, 0.0) is False and t.route("s2", a, 0.0) is False
    assert (a.sessions, a.active_sessions) == (2, 2) and t.home("s1") is a
    assert t.route("s1", b, 1.0) is True and t.moves == 1
    assert (a.sessions, a.active_sessions, b.sessions, b.active_sessions) == (1, 1, 1, 1)
    assert t.home("nobody") is None


def test_idle_sessions_stop_counting_and_come_back_active():
    a = Replica("http://a/v1")
    t = SessionTable(idle_timeout=10)
    t.route("s1", a, 0.0)
    t.route("s2", a, 5.0)
    t.expire(12.0)
    assert (a.sessions, a.active_sessions, t.active) == (2, 1, 1)
    t.route("s1", a, 13.0)  # back from a long tool call: active again, same replica
    assert (a.sessions, a.active_sessions) == (2, 2) and t.home("s1") is a


def test_least_recently_used_sessions_are_forgotten_beyond_the_bound():
    a, b = Replica("http://a/v1"), Replica("http://b/v1")
    t = SessionTable(max_sessions=10, idle_timeout=60)
    for i in range(100):
        t.route(f"s{i}", (a, b)[i % 2], float(i))
    assert len(t) == 10 and a.sessions + b.sessions == 10 and a.active_sessions + b.active_sessions == 10
    assert t.home("s0") is None and t.home("s99") is b


def test_prefix_hit_estimate_credits_the_previous_turn_on_the_same_replica():
    a, b = Replica("http://a/v1"), Replica("http://b/v1")
    t = SessionTable()
    t.route("s", a, 0)
    t.answered("s", a, 100, 20)  # turn 1: nothing cached yet
    t.route("s", a, 1)
    t.answered("s", a, 150, 30)  # turn 2 starts with turn 1's 120 tokens
    t.route("s", b, 2)
    t.answered("s", b, 200, 10)  # turn 3 moved: b never saw this session
    t.route("s", b, 3)
    t.answered("s", b, 260, 10)
    assert (a.stats.prompt_tokens, a.stats.estimated_cached_tokens) == (250, 120)
    assert (b.stats.prompt_tokens, b.stats.estimated_cached_tokens) == (460, 210)
    assert (a.stats.later_turns, a.stats.affinity_hits, b.stats.later_turns, b.stats.affinity_hits) == (1, 1, 2, 1)
    assert a.stats.prefix_hit_estimate == 120 / 250
