"""Issue #19's 1,024-GPU case, rank by rank: the runtime's stage groups on a fake 768-rank world.

The plan (tangram1024_llama2_7b_gbs2048.json) is the one the planner chooses, written by
``python tools/plan.py --cluster examples/clusters/tangram-1024.yaml --model examples/models/llama2-7b.yaml
--global-batch-size 2048 --no-progress --output tests/dryrun/tangram1024_llama2_7b_gbs2048.json``:
256 replicas of [a100-pod TP=1 | h100-pod TP=1 | h100-pod TP=1] on 768 of the 1,024 GPUs, the A100
stages at ranks 512-767 and the H100 stages at 0-511 (so a replica's ranks are not consecutive).
Pure tests check ``rank_roles``; only a simulated rank shows what ``build_stage_groups`` hands that
rank, and that all ranks create the world's 6,912 groups in one order (a real launch deadlocks
otherwise). Creating them costs ~1 s per rank here, so the default suite simulates a sample of ranks
(``sample_ranks``: first/last of every island and stage shape, 0 and 767); re-planning is slow-marked.
The gradient synchronizer's groups of this plan: test_grad_sync_groups.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_het.plan import load_any_plan

from support.fake_world import (
    TIMEOUT,
    creation_order_mismatch,
    expected_multi_rank_groups,
    sample_ranks,
    simulate_ranks,
    stage_group_problems,
    stage_group_view,
)

FIXTURE = Path(__file__).parent / "tangram1024_llama2_7b_gbs2048.json"


@pytest.fixture(scope="module")
def plan():
    return load_any_plan(FIXTURE)


def test_fixture_is_issue_19s_plan(plan):
    assert plan.world_size == 768 and len(plan.replicas) == 256
    shapes = {tuple((s.island, s.tp) for s in rep.stages) for rep in plan.replicas}
    assert shapes == {(("a100-pod", 1), ("h100-pod", 1), ("h100-pod", 1))}


def test_sampled_ranks_get_their_stage_groups_and_create_the_same_groups_in_order(plan, monkeypatch):
    ranks = sample_ranks(plan)
    assert {0, 1, 510, 511, 512, 767} <= set(ranks) and len(ranks) <= 10  # the sample is what was meant
    sims = simulate_ranks(plan, ranks, stage_group_view, monkeypatch)
    assert [p for sim in sims.values() for p in stage_group_problems(plan, sim)] == []
    assert creation_order_mismatch(sims) is None
    calls = sims[0].creations
    # megatron's 9 roles of a TP1 stage all span the rank alone: one group per stage (9 x 768 before)
    assert len(calls) == 768
    assert [c[0] for c in calls if len(c[0]) > 1] == expected_multi_rank_groups(plan) == []  # all TP=1
    assert {c[2] for c in calls} == {TIMEOUT}  # the run's timeout reaches every group


@pytest.mark.slow
def test_planner_still_chooses_the_fixture(plan):
    """The fixture is the planner's current choice (re-planning takes ~10 s): regenerate it when not."""
    from megatron_het.cluster import load_cluster, load_model
    from megatron_het.planner import plan_cluster

    root = Path(__file__).parents[2]
    result = plan_cluster(load_model(root / "examples/models/llama2-7b.yaml"),
                          load_cluster(root / "examples/clusters/tangram-1024.yaml"), global_batch_size=2048)
    assert result.best.replicas == plan.replicas
