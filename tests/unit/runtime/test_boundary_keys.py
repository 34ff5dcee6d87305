"""Which pipeline boundaries get a group, and which group a neighbour is reached on
(runtime/boundary_groups.py): one per pair of neighbour stages, both directions on it."""

from __future__ import annotations

from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.runtime.boundary_groups import group_with, pair_boundaries, plan_boundary_keys


def _stage(ranks, layers):
    return StagePlan(island="cpu", device_type="CPU", ranks=tuple(ranks), layers=layers)


def test_every_boundary_once_in_plan_order_and_both_sides_find_its_group():
    plan = Plan(replicas=(ReplicaPlan(stages=(_stage([0, 1], (0, 2)), _stage([2], (2, 3)), _stage([3, 4], (3, 4))),
                                      num_micro_batches=2),
                          ReplicaPlan(stages=(_stage([5], (0, 4)),), num_micro_batches=2)),
                micro_batch_size=1, global_batch_size=4)
    assert plan_boundary_keys(plan) == [(0, 1, 2), (2, 3, 4)]
    groups = {key: f"g{k}" for k, key in enumerate(plan_boundary_keys(plan))}
    assert group_with((2,), (0, 1), groups) == {"group": "g0"}  # stage 0 -> its next
    assert group_with((0, 1), (2,), groups) == {"group": "g0"}  # stage 1 <- its prev: the same group
    assert group_with((3, 4), (2,), groups) == {"group": "g1"}
    assert group_with((3, 4), (0, 1), groups) == {}  # not neighbours: the default group


def test_two_stage_interleaving_shares_one_group_for_its_boundary_and_its_wrap():
    stages = (_stage([0], (0, 2)), _stage([1], (2, 4)))
    two = Plan(replicas=(ReplicaPlan(stages=stages, num_micro_batches=2),), micro_batch_size=1, global_batch_size=2,
               schedule="interleaved", virtual_pipeline_size=2)
    assert plan_boundary_keys(two) == [(0, 1)]  # 0 -> 1 and the wrap 1 -> 0: one pair of stages
    three = Plan(replicas=(ReplicaPlan(stages=stages + (_stage([2], (4, 4)),), num_micro_batches=3),),
                 micro_batch_size=1, global_batch_size=3, schedule="interleaved", virtual_pipeline_size=2)
    assert plan_boundary_keys(three) == [(0, 1), (1, 2), (0, 2)]  # the wrap 2 -> 0 is a boundary of its own
    assert pair_boundaries([((0,), (1,)), ((1,), (0,)), ((1,), (2,))]) == [(0, 1), (1, 2)]
