"""Rank layout: roles, Megatron rank order, layer splits, interleaved chunk layers."""

import pytest
from megatron.core.parallel_state import RankGenerator

import megatron_het.platform  # noqa: F401  (installs the triton import guard megatron-core needs on CPU)
from megatron_het.plan import (
    Plan,
    PlanError,
    ReplicaPlan,
    StagePlan,
    chunk_layers,
    homogeneous_plan,
    layer_split,
    rank_roles,
    role_of,
)


def _hetero() -> Plan:
    return Plan.load("examples/plans/cpu-demo-hetero.json")


def test_rank_roles_of_hetero_example():
    roles = rank_roles(_hetero())
    assert sorted(roles) == [0, 1, 2, 3]
    r2 = roles[2]
    assert (r2.replica, r2.stage, r2.num_stages, r2.tp_rank, r2.tp_size) == (0, 1, 2, 0, 2)
    assert r2.layers == (3, 4) and r2.island == "slow" and r2.device_type == "CPU"
    assert r2.is_last_stage and not r2.is_first_stage
    assert roles[1].is_first_stage and roles[1].tp_rank == 1


def test_role_of_unknown_rank_names_world_size():
    with pytest.raises(PlanError) as e:
        role_of(_hetero(), 4)
    assert "rank 4 is not in the plan" in str(e.value)
    assert "world size 4" in str(e.value)


def test_rank_roles_rejects_duplicate_rank():
    stage = StagePlan(island="a", device_type="CPU", ranks=(0, 0), layers=(0, 1))
    plan = Plan(replicas=(ReplicaPlan(stages=(stage,), num_micro_batches=1),),
                micro_batch_size=1, global_batch_size=1)
    with pytest.raises(PlanError, match=r"replicas\[0\]\.stages\[0\]\.ranks\[1\].*already used"):
        rank_roles(plan)


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 2, 2), (2, 4, 1), (1, 3, 2), (4, 2, 3)])
def test_homogeneous_plan_matches_megatron_rank_generator(tp, pp, dp):
    plan = homogeneous_plan(tp=tp, pp=pp, dp=dp, num_layers=12, micro_batch_size=1,
                            global_batch_size=dp * 4)
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    tp_groups = sorted(tuple(g) for g in gen.get_ranks("tp"))
    pp_groups = sorted(tuple(g) for g in gen.get_ranks("pp"))
    dp_groups = sorted(tuple(g) for g in gen.get_ranks("dp"))
    ours_tp = sorted(s.ranks for r in plan.replicas for s in r.stages)
    assert ours_tp == tp_groups
    # A pipeline group is the tp_rank-th rank of each stage of one replica.
    ours_pp = sorted(tuple(s.ranks[t] for s in r.stages) for r in plan.replicas for t in range(tp))
    assert ours_pp == pp_groups
    # A data-parallel group is the same (stage, tp_rank) position across replicas.
    ours_dp = sorted(
        tuple(r.stages[p].ranks[t] for r in plan.replicas) for p in range(pp) for t in range(tp)
    )
    assert ours_dp == dp_groups
    assert plan.world_size == tp * pp * dp
    assert all(r.num_micro_batches == 4 for r in plan.replicas)


def test_homogeneous_plan_explicit_formula_and_layers():
    plan = homogeneous_plan(tp=2, pp=2, dp=2, num_layers=6, micro_batch_size=2, global_batch_size=16,
                            layers_per_stage=[4, 2])
    # rank = pp_rank*(dp*tp) + dp_rank*tp + tp_rank
    assert plan.replicas[1].stages[0].ranks == (2, 3)
    assert plan.replicas[0].stages[1].ranks == (4, 5)
    assert plan.replicas[1].stages[1].layers == (4, 6)
    assert plan.replicas[0].num_micro_batches == 4


def test_homogeneous_plan_errors():
    with pytest.raises(PlanError, match=r"micro_batch_size \* dp = 2 \* 3 = 6"):
        homogeneous_plan(tp=1, pp=1, dp=3, num_layers=4, micro_batch_size=2, global_batch_size=16)
    with pytest.raises(PlanError, match="5 layers do not split evenly over pp=2"):
        homogeneous_plan(tp=1, pp=2, dp=1, num_layers=5, micro_batch_size=1, global_batch_size=4)
    with pytest.raises(PlanError, match="summing to num_layers=5"):
        homogeneous_plan(tp=1, pp=2, dp=1, num_layers=5, micro_batch_size=1, global_batch_size=4,
                         layers_per_stage=[2, 2])


def test_layer_split_proportional_and_deterministic():
    assert layer_split(4, [3, 1]) == ((0, 3), (3, 4))
    assert layer_split(12, [1, 1, 1]) == ((0, 4), (4, 8), (8, 12))
    assert layer_split(10, [2, 1]) == ((0, 7), (7, 10))  # ideal 6.67 / 3.33
    assert layer_split(7, [1, 1]) == ((0, 4), (4, 7))  # tie goes to the earlier stage
    # A very slow stage still gets one layer.
    assert layer_split(8, [100, 1]) == ((0, 7), (7, 8))
    assert layer_split(3, [1, 1, 1]) == ((0, 1), (1, 2), (2, 3))


def test_layer_split_errors():
    with pytest.raises(PlanError, match="3 stages need at least 3 layers but num_layers is 2"):
        layer_split(2, [1, 1, 1])
    with pytest.raises(PlanError, match=r"weights\[1\].*> 0"):
        layer_split(4, [1, 0])


def test_chunk_layers_matches_megatron_for_uniform_and_splits_uneven():
    uniform = homogeneous_plan(tp=1, pp=2, dp=1, num_layers=8, micro_batch_size=1,
                               global_batch_size=2).replicas[0]
    # Megatron: virtual stage v = c*p + s holds layers [2v, 2v+2).
    assert chunk_layers(uniform, 2) == (((0, 2), (4, 6)), ((2, 4), (6, 8)))
    uneven = homogeneous_plan(tp=1, pp=2, dp=1, num_layers=8, micro_batch_size=1, global_batch_size=2,
                              layers_per_stage=[6, 2]).replicas[0]
    assert chunk_layers(uneven, 2) == (((0, 3), (4, 7)), ((3, 4), (7, 8)))
    assert chunk_layers(uneven, 1) == (((0, 6),), ((6, 8),))
    with pytest.raises(PlanError, match=r"stages\[0\]\.layers: 6 layers cannot be split into virtual_pipeline_size=4"):
        chunk_layers(uneven, 4)
