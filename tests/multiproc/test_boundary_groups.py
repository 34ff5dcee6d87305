"""Every direction of a pipeline boundary has its own group (runtime/boundary_groups.py), on a real
5-rank gloo launch of a TP 2 -> 1 -> 2 pipeline: the group a stage sends forward on is the one its
successor receives on, the backward direction is another group over the same ranks, and a step runs
on them. (NCCL/RCCL deadlock in 1F1B when both directions share one group; gloo, which matches by
tag, does not, so what this checks is the wiring; tests/unit/runtime/test_boundary_streams.py shows
the deadlock on a model of NCCL's per-group stream.) ~20 s."""

from __future__ import annotations

import math

import pytest

from megatron_het.cluster import ModelSpec
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local
from megatron_het.train.config import TrainConfig

from workers.boundary_group_workers import boundary_groups_worker

MODEL = ModelSpec(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200)
TRAIN = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=1, lr=1e-3)
STAGES = ((0, 1), (2,), (3, 4))
PLAN = Plan(replicas=(ReplicaPlan(stages=tuple(
    StagePlan(island="cpu", device_type="CPU", ranks=r, layers=(i, i + 1)) for i, r in enumerate(STAGES)),
    num_micro_batches=4),), micro_batch_size=2, global_batch_size=8)


@pytest.fixture(scope="module")
def per_rank():
    return run_local(5, boundary_groups_worker, (MODEL, PLAN, TRAIN), timeout_s=600)


@pytest.mark.multiproc
def test_each_direction_of_a_boundary_is_its_own_group_shared_by_both_sides(per_rank):
    for s in range(len(STAGES) - 1):
        up, down = STAGES[s], STAGES[s + 1]
        both = tuple(sorted((*up, *down)))
        forward_sent = {per_rank[r][0]["next"][0] for r in up}  # (name, ranks) each upstream rank sends on
        forward_received = {per_rank[r][0]["prev"][1] for r in down}
        backward_sent = {per_rank[r][0]["prev"][0] for r in down}
        backward_received = {per_rank[r][0]["next"][1] for r in up}
        assert len(forward_sent) == 1 and forward_sent == forward_received, (s, forward_sent, forward_received)
        assert len(backward_sent) == 1 and backward_sent == backward_received, (s, backward_sent, backward_received)
        (fwd_name, fwd_ranks), = forward_sent
        (bwd_name, bwd_ranks), = backward_sent
        assert fwd_ranks == bwd_ranks == both
        assert fwd_name != bwd_name  # two groups: each direction its own queue
    ends = {r: set(per_rank[r][0]) for r in range(5)}
    assert ends == {0: {"next"}, 1: {"next"}, 2: {"prev", "next"}, 3: {"prev"}, 4: {"prev"}}


@pytest.mark.multiproc
def test_a_step_runs_over_the_direction_groups(per_rank):
    losses = [per_rank[r][1] for r in STAGES[-1]]  # the last stage reports the loss
    assert all(len(x) == 1 and math.isfinite(x[0]) for x in losses)
    assert losses[0] == losses[1]
