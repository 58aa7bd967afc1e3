"""The circuit breaker's state machine, driven by a hand-set clock."""

from __future__ import annotations

import pytest

from gymserve.backends.routing.breaker import CircuitBreaker
from helpers.clock import ManualClock


def test_opens_after_consecutive_failures_then_half_open_then_closes():
    clock = ManualClock(1000.0)
    b = CircuitBreaker(3, 10.0, clock=clock)
    b.failure("500")
    b.failure("500")
    b.success()  # a success in between resets the count
    b.failure("500")
    b.failure("500")
    assert b.state == "closed" and b.allows()
    b.failure("503 engine exploded")
    assert b.state == "open" and not b.allows() and b.opens == 1 and b.last_reason == "503 engine exploded"
    clock.now += 9.9
    assert b.state == "open"
    clock.now += 0.1
    assert b.state == "half_open" and b.allows()
    b.on_pick()  # the trial call
    assert not b.allows()  # one trial at a time
    b.success()
    assert b.state == "closed" and b.allows() and b.failures == 0


def test_failed_trial_reopens_with_a_doubled_cooldown_capped_at_8x():
    clock = ManualClock(1000.0)
    b = CircuitBreaker(1, 2.0, clock=clock)
    b.failure("x")
    cooldowns = []
    for _ in range(6):
        cooldowns.append(b.current_cooldown)
        clock.now += b.current_cooldown
        assert b.state == "half_open"
        b.on_pick()
        b.failure("still broken")
        assert b.state == "open"
    assert cooldowns == [2.0, 4.0, 8.0, 16.0, 16.0, 16.0]
    clock.now += 16
    b.on_pick()
    b.success()
    assert b.current_cooldown == 2.0  # a success resets the growth


def test_trip_opens_at_once_and_a_probe_answer_allows_a_trial():
    clock = ManualClock(1000.0)
    b = CircuitBreaker(5, 30.0, clock=clock)
    b.trip("connection refused")
    assert b.state == "open" and b.opens == 1
    b.probe_answered()
    assert b.state == "half_open" and b.allows()


def test_a_cancelled_trial_frees_the_slot_and_failures_of_old_calls_do_not_extend_the_opening():
    clock = ManualClock(1000.0)
    b = CircuitBreaker(1, 10.0, clock=clock)
    b.failure("x")
    clock.now += 5
    b.failure("a call sent before it opened")
    assert b.current_cooldown == 10.0 and b.opens == 1
    clock.now += 5
    b.on_pick()
    b.cancelled()
    assert b.allows()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="failure_threshold >= 1"):
        CircuitBreaker(0, 1.0)
