"""The consistent-hash policy: stable, spread, and only a leaving replica's sessions move."""

from __future__ import annotations

from gymserve.backends.pool import Replica
from gymserve.backends.routing.consistent_hash import ConsistentHash, ring_hash


def test_ring_hash_is_stable_across_processes():
    # BLAKE2b-64 of the key, big-endian: the same in every process (unlike hash(), salted per process).
    assert ring_hash("rollout-42") == 0x4C64638FF8388861


def test_sessions_spread_and_only_the_leaving_replicas_sessions_move():
    replicas = [Replica(f"http://10.0.0.{i}:8000/v1") for i in range(8)]
    policy = ConsistentHash(replicas, None)
    sessions = [f"s{i}" for i in range(8000)]
    before = {s: policy.place(lambda r: True, s) for s in sessions}
    shares = [sum(1 for r in before.values() if r is rep) for rep in replicas]
    assert min(shares) > 0.75 * 1000 and max(shares) < 1.25 * 1000, shares
    gone = replicas[3]
    after = {s: policy.place(lambda r: r is not gone, s) for s in sessions}
    moved = [s for s in sessions if after[s] is not before[s]]
    assert moved and all(before[s] is gone for s in moved)
    assert {after[s] for s in moved} - {gone} and gone not in after.values()
    assert policy.place(lambda r: False, "s1") is None
