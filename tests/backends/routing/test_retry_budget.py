"""The retry budget: a floor plus a fraction of recent successes, expiring after the window."""

from __future__ import annotations

import pytest

from gymserve.backends.routing.retry_budget import RetryBudget
from helpers.clock import ManualClock


def test_floor_then_a_fraction_of_successes():
    clock = ManualClock(500.0)
    b = RetryBudget(ratio=0.2, min_per_s=0.3, window=10, clock=clock)  # floor: 3 retries per window
    assert b.balance == pytest.approx(3)
    assert [b.try_withdraw() for _ in range(4)] == [True, True, True, False]
    assert b.retries == 3 and b.denied == 1
    for _ in range(10):
        b.deposit()  # 10 successes x 0.2 = 2 more
    assert b.balance == pytest.approx(2)
    assert [b.try_withdraw() for _ in range(3)] == [True, True, False]


def test_deposits_and_withdrawals_expire_after_the_window():
    clock = ManualClock(500.0)
    b = RetryBudget(ratio=1.0, min_per_s=0, window=10, clock=clock)
    assert not b.try_withdraw()  # no floor, no successes: no retries at all
    for _ in range(5):
        b.deposit()
    assert b.try_withdraw() and b.balance == pytest.approx(4)
    clock.now += 5
    assert b.balance == pytest.approx(4)
    clock.now += 6  # past the window: the deposits and the withdrawal are gone
    assert b.balance == pytest.approx(0)


def test_a_storm_is_bounded_by_the_floor():
    """Every call failing: retries stay at the floor, not one per call."""
    clock = ManualClock(500.0)
    b = RetryBudget(ratio=0.2, min_per_s=1, window=10, clock=clock)
    allowed = 0
    for _ in range(10_000):  # 10,000 failing calls within one second
        allowed += b.try_withdraw()
    assert allowed == 10


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="1 <= window <= 60"):
        RetryBudget(window=0.5)
