"""Each pipeline boundary has one group (runtime/boundary_groups.py), on a real 5-rank gloo launch of
a TP 2 -> 1 -> 2 pipeline: the group a stage reaches its successor on is the one its successor
reaches it on, over both stages' ranks, and a step runs on them (each step's transfers with one
neighbour batched on it; tests/unit/schedule/test_transfer_streams.py shows on a model of NCCL's
weakest promise that this cannot deadlock, and that unbatched transfers on one group did). ~20 s."""

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
def test_each_boundary_is_one_group_shared_by_both_sides(per_rank):
    names = set()
    for s in range(len(STAGES) - 1):
        up, down = STAGES[s], STAGES[s + 1]
        seen = {per_rank[r][0]["next"] for r in up} | {per_rank[r][0]["prev"] for r in down}
        assert len(seen) == 1, (s, seen)  # (name, ranks): one group, both directions, every rank of both stages
        (name, ranks), = seen
        assert ranks == tuple(sorted((*up, *down)))
        names.add(name)
    assert len(names) == len(STAGES) - 1
    ends = {r: set(per_rank[r][0]) for r in range(5)}
    assert ends == {0: {"next"}, 1: {"next"}, 2: {"prev", "next"}, 3: {"prev"}, 4: {"prev"}}


@pytest.mark.multiproc
def test_a_step_runs_over_the_boundary_groups(per_rank):
    losses = [per_rank[r][1] for r in STAGES[-1]]  # the last stage reports the loss
    assert all(len(x) == 1 and math.isfinite(x[0]) for x in losses)
    assert losses[0] == losses[1]
