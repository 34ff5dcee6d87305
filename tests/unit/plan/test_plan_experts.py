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
