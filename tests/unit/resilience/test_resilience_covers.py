"""Covers across different layouts (pure): a lost stage is run by the union of overlapping peers."""

from __future__ import annotations

import pytest

from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.resilience.routed_schedule import routed_schedule
from megatron_het.resilience.routing import ReroutingError, best_cover, describe, reroute


def layout(*replicas: tuple[tuple[int, int], ...], micro: int = 2) -> Plan:
    """One replica per tuple of layer ranges; ranks numbered in order, TP 1."""
    rank, out = 0, []
    for ranges in replicas:
        stages = []
        for lo, hi in ranges:
            stages.append(StagePlan(island="cpu", device_type="CPU", ranks=(rank,), layers=(lo, hi)))
            rank += 1
        out.append(ReplicaPlan(stages=tuple(stages), num_micro_batches=micro))
    return Plan(replicas=tuple(out), micro_batch_size=2, global_batch_size=2 * micro * len(out))


ISSUE = layout(((0, 8), (8, 16), (16, 24)), ((0, 6), (6, 12), (12, 20), (20, 24)), ((0, 10), (10, 24)))


def test_the_issue_example_8_16_is_covered_by_6_12_and_12_20():
    r = reroute(ISSUE, (1,))  # replica 0's stage of layers 8-16
    p = r.pipelines[0]
    assert p.hops == ((0, 0), (1, 1), (1, 2), (0, 2)) and p.spans == ((0, 8), (8, 12), (12, 16), (16, 24))
    assert r.windows((1, 1)) == dict.fromkeys(p.micro_batches, (2, 6))  # local layers of its 6-12
    assert r.windows((1, 2)) == dict.fromkeys(p.micro_batches, (0, 4))
    lines = describe(r)
    assert any("replica 1 stage 1 (ranks [4]) on layers 8-12 of its 6-12" in line for line in lines), lines
    assert any("replica 1 stage 2 (ranks [5]) on layers 12-16 of its 12-20" in line for line in lines), lines


def test_roles_are_kept_a_first_stage_never_takes_an_activation_a_last_never_hands_one_on():
    # replica 2's [0,10) holds 8-10 but holds the embedding; [10,24) holds the loss: neither may cover 8-16 alone
    r = reroute(ISSUE, (1,))
    assert all(h not in ((2, 0), (2, 1)) for h in r.pipelines[0].hops)
    with pytest.raises(ReroutingError, match=r"replicas\[0\]\.stages\[1\]: no surviving stages cover layers \[8, 16\]"):
        reroute(layout(((0, 8), (8, 16), (16, 24)), ((0, 10), (10, 24))), (1,))


def test_the_cover_with_the_least_added_time_wins():
    # peers 6-12 and 12-20 (replica 1) or 4-12 and 12-18 (replica 2): replica 2's peers are 4x faster per
    # micro-batch (cost), so the cover of 8-16 takes them
    plan = layout(((0, 8), (8, 16), (16, 24)), ((0, 6), (6, 12), (12, 20), (20, 24)),
                  ((0, 4), (4, 12), (12, 18), (18, 24)))
    slow = {(1, s): 4.0 for s in range(4)}
    fast = {(2, s): 1.0 for s in range(4)}
    own = {(0, s): 1.0 for s in range(3)}
    r = reroute(plan, (1,), seconds_per_micro_batch={**slow, **fast, **own})
    assert r.pipelines[0].hops[1:3] == ((2, 1), (2, 2))
    r = reroute(plan, (1,), seconds_per_micro_batch={**{k: 4.0 for k in fast}, **{k: 1.0 for k in slow}, **own})
    assert r.pipelines[0].hops[1:3] == ((1, 1), (1, 2))


def test_split_point_balances_two_overlapping_peers():
    # lost 8-16; peer A 6-14 and peer B 10-18 overlap on 10-14: equal speed per layer -> split in the middle
    peers = layout(((0, 6), (6, 14), (14, 24)), ((0, 10), (10, 18), (18, 24)))
    from megatron_het.resilience.routing import _instances

    alive, _ = _instances(peers, frozenset())
    by = {i.key: i for i in alive}
    cost = {k: (i.layers[1] - i.layers[0]) * 1.0 for k, i in by.items()}  # 1 per layer
    chain = best_cover((8, 16), [by[(0, 1)], by[(1, 1)]], num_layers=24, cost=cost,
                       load=dict.fromkeys(by, 0.0), micro_batches=1)
    assert chain == (((0, 1), (8, 12)), ((1, 1), (12, 16)))


@pytest.mark.parametrize("failed", [(1,), (0,), (2,), (1, 8), (0, 3)])
def test_every_sample_once_and_schedules_complete(failed):
    r = reroute(ISSUE, failed)
    assert sorted(r.samples()) == list(range(ISSUE.global_batch_size))
    sched = routed_schedule(r)
    runs = sum(len(p.micro_batches) * len(p.hops) for p in r.pipelines)
    assert sum(len(a) for a in sched.actions.values()) == 3 * runs


def test_partial_hops_cost_their_share_in_the_simulator():
    r = reroute(ISSUE, (1,))
    sched = routed_schedule(r, split_backward=False)
    # replica 1's 6-12 stage runs its own micro-batches fully (F 1 + fused backward 2 units) and
    # replica 0's on 4 of its 6 layers
    own, covered = len(r.pipelines[1].micro_batches), len(r.pipelines[0].micro_batches)
    assert own > 0 and covered > 0
    assert sched.busy[(1, 1)] == pytest.approx(own * 3 + covered * 3 * 4 / 6)
