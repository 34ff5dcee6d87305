"""Expert parallelism's rank layout (plan/experts.py): megatron-core's expert grid over a plan's
expert domains, pure logic."""

from __future__ import annotations

import pytest

from megatron_het.plan import PlanError
from megatron_het.plan.experts import (
    domain_of,
    expert_domains,
    expert_groups,
    is_expert_param,
    rank_expert_layout,
    stage_expert_grids,
)


def test_ep_over_replicas_pairs_the_same_tp_rank_of_each():
    # a stage of TP 2 in 4 replicas, EP 4 with expert-TP = TP: Megatron's EP over DP
    k = expert_domains(4, [[2], [2], [2], [2]], ep=4, etp=None)
    assert k == 4
    ranks = [0, 1, 10, 11, 20, 21, 30, 31]  # the stage's ranks, replica by replica
    ep_groups, etp_groups = expert_groups(ranks, ep=4, etp=2)
    assert ep_groups == [[0, 10, 20, 30], [1, 11, 21, 31]]
    assert etp_groups == [[0, 1], [10, 11], [20, 21], [30, 31]]


def test_ep_inside_a_stage_splits_its_tp_ranks():
    # TP 4 attention, experts over EP 2 x expert-TP 2 inside the stage: one replica per domain
    assert expert_domains(3, [[4], [4], [4]], ep=2, etp=2) == 1
    ep_groups, etp_groups = expert_groups([8, 9, 10, 11], ep=2, etp=2)
    assert ep_groups == [[8, 10], [9, 11]] and etp_groups == [[8, 9], [10, 11]]
    layout = rank_expert_layout(3, num_experts=8, ep=2, etp=2)  # rank 11
    assert (layout.ep_rank, layout.etp_rank, layout.num_local, layout.first_expert) == (1, 1, 4, 4)
    assert layout.tp_coordinates("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", 3, 4) == (1, 2)
    assert layout.tp_coordinates("decoder.layers.0.self_attention.linear_qkv.weight", 3, 4) == (3, 4)


def test_domains_are_consecutive_replicas():
    assert list(domain_of(5, 2)) == [4, 5] and list(domain_of(4, 2)) == [4, 5] and list(domain_of(0, 1)) == [0]


@pytest.mark.parametrize("replicas,tps,ep,etp,match", [
    (2, [[2], [2]], 3, None, "spans 3 replicas, which do not divide the plan's 2"),
    (4, [[2, 1], [2, 1], [2, 1], [2, 1]], 2, 1, "different numbers of replicas"),
    (2, [[4], [4]], 1, 2, "EP 1 x expert-TP 2 = 2 is not a multiple of a stage's TP 4"),
])
def test_bad_expert_layouts_name_the_problem(replicas, tps, ep, etp, match):
    with pytest.raises(PlanError, match=match):
        expert_domains(replicas, tps, ep=ep, etp=etp)


def test_only_routed_experts_are_expert_params():
    assert is_expert_param("decoder.layers.3.mlp.experts.local_experts.0.linear_fc2.weight")
    assert not is_expert_param("decoder.layers.3.mlp.router.weight")
    assert not is_expert_param("decoder.layers.3.mlp.shared_experts.linear_fc1.weight")


# ---- a plan's expert fields, validated against the model -------------------------------------------

def _moe(**kw):
    from megatron_het.cluster import ModelSpec

    return ModelSpec(**{"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                        "vocab_size": 200, "num_experts": 4, "add_bias_linear": False, **kw})


def _two_replicas(**kw):
    from dataclasses import replace

    from support.parity_plans import plan, stage

    return replace(plan(([stage([0], (0, 3)), stage([1], (3, 4))], 2),
                        ([stage([2], (0, 3)), stage([3], (3, 4))], 2)), **kw)


def test_expert_fields_round_trip_and_are_written_only_when_set():
    from megatron_het.plan import Plan

    ep = _two_replicas(expert_parallel=2, expert_tensor_parallel=1)
    back = Plan.from_dict(ep.to_dict())
    assert (back.expert_parallel, back.expert_tensor_parallel) == (2, 1)
    assert "expert_parallel" not in _two_replicas().to_dict()  # dense-era plan files stay byte for byte


@pytest.mark.parametrize("model_kw,plan_kw,match", [
    ({"num_experts": None}, {"expert_parallel": 2}, "the model has no experts"),
    ({"num_experts": 6}, {"expert_parallel": 4}, "does not divide num_experts=6"),
    ({"add_bias_linear": True}, {}, "experts have linear biases"),
])
def test_plan_expert_checks(model_kw, plan_kw, match):
    with pytest.raises(PlanError, match=match):
        _two_replicas(**plan_kw).validate(_moe(**model_kw))


def test_expert_biases_run_with_expert_parallelism_at_expert_tp_1():
    _two_replicas(expert_parallel=2).validate(_moe(add_bias_linear=True))  # megatron-core takes them here


def test_an_expert_domain_needs_identical_replicas():
    from dataclasses import replace

    from support.parity_plans import plan, stage

    uneven = replace(plan(([stage([0], (0, 3)), stage([1], (3, 4))], 3),
                          ([stage([2], (0, 3)), stage([3], (3, 4))], 1)), expert_parallel=2)
    with pytest.raises(PlanError, match=r"replicas 0..1 share their experts .* differ"):
        uneven.validate(_moe())


def test_plan_holdings_hold_every_expert_once_per_domain():
    """The holdings of every rank (runtime/holdings.plan_holdings, the gradient synchronizer's input):
    each (layer, expert) is held by exactly one rank of each replica pair under EP 2 over replicas,
    under global names, and every rank of a stage holds half of them."""
    from collections import Counter

    from megatron_het.runtime.holdings import plan_holdings

    plan, model = _two_replicas(expert_parallel=2), _moe()
    holders = Counter()
    per_rank = Counter()
    for h in plan_holdings(plan, model):
        if is_expert_param(h.name) and h.name.endswith("linear_fc1.weight"):
            holders[h.name] += 1
            per_rank[h.rank] += 1
    assert len(holders) == 4 * 4 and set(holders.values()) == {1}, holders  # 4 layers x 4 experts, once each
    assert per_rank == {0: 6, 2: 6, 1: 2, 3: 2}  # stage 0: 3 layers x 2 experts; stage 1: 1 layer x 2


@pytest.mark.parametrize("case", ["pp2x3_pp2x1", "ep2_over_replicas", "ep2_in_tp2_stages", "ep4_over_tp2_replicas",
                                  "ep2_etp2_distopt"])
def test_memory_model_counts_the_parameters_each_rank_builds(case):
    """perf.memory.rank_memory's parameters of every rank of an MoE plan, with and without expert
    parallelism, equal the elements of the megatron-core modules the rank builds (plan_holdings: the
    trainer's model on the meta device)."""
    import math

    from megatron_het.perf.memory import rank_memory, runtime_state_bytes
    from megatron_het.runtime.holdings import plan_holdings, plan_padded_vocab

    from support.moe_plans import CASES, MIXTRAL_LIKE

    plan, model = CASES[case], MIXTRAL_LIKE
    vocab = plan_padded_vocab(model, plan)
    built = {}
    for h in plan_holdings(plan, model, padded_vocab=vocab):
        numel = math.prod(h.full_shape) // (h.tp_size if h.partition_dim is not None else 1)
        built[h.rank] = built.get(h.rank, 0) + numel
    weight_b = runtime_state_bytes("fp32", distributed_optimizer=plan.use_distributed_optimizer)[0]
    for rank, numel in built.items():
        predicted = rank_memory(model, plan, rank, precision="fp32", padded_vocab=vocab).parameters_bytes // weight_b
        assert predicted == numel, (case, rank, predicted, numel)


def test_a_domain_out_of_rank_order_keeps_one_grid():
    """Replicas of a domain listed out of rank order, expert-TP 2 over TP-1 stages: each expert-TP
    group holds one EP rank's experts, and a rank's place in the (expert-TP x EP) group is
    ep_rank x etp + etp_rank by global rank, as megatron-core's alltoall dispatcher reads it."""
    from megatron_het.plan.experts import plan_expert_layouts

    layouts = plan_expert_layouts([[[0]], [[3]], [[1]], [[2]]], num_experts=4, ep=2, etp=2)
    (ranks, _), = stage_expert_grids([[[0]], [[3]], [[1]], [[2]]], ep=2, etp=2)
    ep_groups, etp_groups = expert_groups(ranks, ep=2, etp=2)
    for g in etp_groups:
        assert len({layouts[r].ep_rank for r in g}) == 1 and sorted(layouts[r].etp_rank for r in g) == [0, 1]
    for position, rank in enumerate(sorted(ranks)):
        assert layouts[rank].ep_rank * 2 + layouts[rank].etp_rank == position


def test_recomputation_must_match_across_a_domain():
    from dataclasses import replace

    plan = _two_replicas(expert_parallel=2)
    r1 = plan.replicas[1]
    odd = replace(plan, replicas=(plan.replicas[0], replace(r1, stages=(replace(r1.stages[0], recompute=True),
                                                                          r1.stages[1]))))
    with pytest.raises(PlanError, match="recomputation"):
        odd.validate(_moe())


def test_a_shared_expert_has_no_biases():
    from megatron_het.cluster import ConfigError

    with pytest.raises(ConfigError, match="shared expert has no linear biases"):
        _moe(add_bias_linear=True, moe_shared_expert_intermediate_size=64)


def test_an_expert_domain_across_collective_libraries_is_refused_before_any_group():
    from dataclasses import replace

    from megatron_het.runtime.stage_groups import _expert_groups

    from support.parity_plans import plan, stage

    mixed = replace(plan(([stage([0], (0, 4), "nv", "A100-80GB")], 2), ([stage([1], (0, 4), "amd", "MI250X")], 2)),
                    expert_parallel=2)
    with pytest.raises(ValueError, match=r"different collective libraries \(\['nccl', 'rccl'\]\)"):
        _expert_groups(mixed, {}, 0, timeout=None, backend_of=None, device_id=None,
                       library_of={"nv": "nccl", "amd": "rccl"}.get)


def test_expert_flags_set_only_what_they_give_and_refuse_another_plan_value():
    from types import SimpleNamespace

    from megatron_het.cli.pretrain import apply_expert_flags
    from megatron_het.cluster import ConfigError

    recorded = _two_replicas(expert_parallel=2, expert_tensor_parallel=1)
    # --expert-tensor-parallel-size 1 alone keeps the plan's EP 2
    kept = apply_expert_flags(recorded, SimpleNamespace(expert_model_parallel_size=1, expert_tensor_parallel_size=1))
    assert (kept.expert_parallel, kept.expert_tensor_parallel) == (2, 1)
    with pytest.raises(ConfigError, match="--expert-model-parallel-size: the plan records expert_parallel 2"):
        apply_expert_flags(recorded, SimpleNamespace(expert_model_parallel_size=4, expert_tensor_parallel_size=None))
    set_ = apply_expert_flags(_two_replicas(), SimpleNamespace(expert_model_parallel_size=2,
                                                                expert_tensor_parallel_size=None))
    assert (set_.expert_parallel, set_.expert_tensor_parallel) == (2, None)
