"""planner/gap.py: the fluid ceiling and the one-island capacity are upper bounds of what the
planner's own plans achieve (if they were not, the efficiency bench's "unreachable" claims would be
wrong), and the capacity counts whole micro-batches."""

import pytest

from megatron_het.cluster import load_cluster, load_model
from megatron_het.planner import plan_cluster
from megatron_het.planner.estimate import Estimator
from megatron_het.planner.gap import best_rate, fluid_tokens_per_s, island_capacity, one_island_time

from support.paths import EXAMPLES

LLAMA7 = load_model(EXAMPLES / "models/llama2-7b.yaml")
CLUSTER = load_cluster(EXAMPLES / "clusters/a100-h100.yaml")  # 32 A100 + 16 H100
GBS = 256


@pytest.fixture(scope="module")
def est():
    return Estimator(LLAMA7, CLUSTER, global_batch_size=GBS, profile=None, distributed_optimizer=True)


@pytest.mark.parametrize("island", ["a100-pod", "h100-pod"])
def test_capacity_bounds_the_planners_own_one_island_plan(est, island):
    """The best plan on the island alone finishes GBS sequences in its pipeline time, so the bound
    at that time must hold at least GBS (it ignores transfers, imbalance, reduction, optimizer)."""
    plan, pred = plan_cluster(LLAMA7, CLUSTER, global_batch_size=GBS, islands=[island]).candidates[0]
    isl = CLUSTER.island_names.index(island)
    capacity, family = island_capacity(est, isl, pred.pipeline_time_s * (1 + 1e-9))
    assert capacity >= GBS, (capacity, family, pred.pipeline_time_s)
    # ... and at 60% of that time it must not claim the plan's throughput could be beaten by 1/0.6:
    # the bound is an ideal, not a guess, so it stays below the fluid rate times the time.
    rate, _ = best_rate(est, isl)
    assert island_capacity(est, isl, 0.6 * pred.pipeline_time_s)[0] <= rate * CLUSTER.islands[isl].num_gpus \
        * 0.6 * pred.pipeline_time_s + 1e-9


def test_fluid_bounds_the_joint_plan_and_each_island(est):
    fluid = fluid_tokens_per_s(est, [0, 1])
    joint = plan_cluster(LLAMA7, CLUSTER, global_batch_size=GBS).candidates[0][1].tokens_per_s
    assert joint <= fluid
    for i, name in enumerate(CLUSTER.island_names):
        alone = plan_cluster(LLAMA7, CLUSTER, global_batch_size=GBS, islands=[name]).candidates[0][1].tokens_per_s
        assert alone <= fluid_tokens_per_s(est, [i])
    assert fluid == pytest.approx(fluid_tokens_per_s(est, [0]) + fluid_tokens_per_s(est, [1]), rel=1e-12)


def test_capacity_counts_whole_micro_batches(est):
    """Zero below one micro-batch; a non-decreasing step function of the time otherwise,
    equal to the hand count for data parallelism of whole-model replicas (TP=1, PP=1)."""
    h100 = CLUSTER.island_names.index("h100-pod")
    rate, family = best_rate(est, h100)
    assert family is not None and rate > 0
    assert island_capacity(est, h100, 1e-4)[0] == 0  # shorter than any micro-batch of any layout
    grid = [0.1 * k for k in range(1, 40)]
    caps = [island_capacity(est, h100, s)[0] for s in grid]
    assert caps == sorted(caps)
    # Hand count: 16 replicas of TP=1, one stage, micro-batch size 1, no recompute.
    fixed, per_layer, _ = est.rows(h100, 1, 1, True, True, True, 1, 1)[0]
    t = fixed + LLAMA7.num_layers * per_layer
    assert island_capacity(est, h100, 3.5 * t)[0] >= 16 * 3


def test_one_island_time_is_where_the_capacity_reaches_the_batch(est):
    both = [0, 1]
    t = one_island_time(est, both, GBS)
    assert sum(island_capacity(est, i, t)[0] for i in both) >= GBS
    assert sum(island_capacity(est, i, t * (1 - 1e-3))[0] for i in both) < GBS
    # no faster than the fluid time, and no slower than either island alone
    assert t >= GBS * LLAMA7.seq_length / fluid_tokens_per_s(est, both)
    assert t <= min(one_island_time(est, [i], GBS) for i in both)


def test_a_recomputing_family_is_priced_at_the_plain_layer_time(est):
    """The planner recomputes only the layers a stage needs (block method), so a family allowed to
    recompute may cost as little as the same layout without recompute: the bound prices it so."""
    from megatron_het.planner.gap import _families

    for isl in range(len(CLUSTER.islands)):
        fams = list(_families(est, isl))
        plain = {(f.tp, f.pp, f.micro_batch_size): f.micro_batch_s for f in fams if not f.recompute}
        recomputing = [f for f in fams if f.recompute]
        assert recomputing
        for f in recomputing:
            if (f.tp, f.pp, f.micro_batch_size) in plain:
                assert f.micro_batch_s == plain[(f.tp, f.pp, f.micro_batch_size)]
            # the plain row's time even where only full recompute's memory cap holds the layers
            c = est.cost(isl, f.tp, f.micro_batch_size, False)
            assert f.micro_batch_s == pytest.approx(
                c.embedding_forward_s + c.embedding_backward_s + c.output_forward_s + c.output_backward_s
                + LLAMA7.num_layers * (c.layer_forward_s + c.layer_backward_s), rel=1e-12)
