"""A 480-rank plan of uneven TP across two islands, rank by rank on torch's fake backend.

48 replicas of [nv TP=2 | amd TP=4] and 32 of [amd TP=4 as a 2x2x1 AxoNN grid | nv TP=2]: stages of
different sizes side by side, each island's ranks handed out in replica order, so a replica's stages sit
far apart. Each simulated rank runs what ``PipelineStrategy.__init__`` runs before it needs data from
other ranks: ``build_stage_groups`` then ``create_plan_grid_groups`` (3D stages' axis groups). Checked:
its stage groups and role, its grid's x/y/z groups against the grid layout (x fastest), and one world-wide
order of creation. The gradient synchronizer's groups of this plan: test_grad_sync_groups.py.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_het.plan import Plan, rank_roles
from megatron_het.runtime.tp3d_groups import create_plan_grid_groups

from support.dryrun_plans import B_COUNT, uneven_plan
from support.fake_world import (
    TIMEOUT,
    creation_order_mismatch,
    expected_multi_rank_groups,
    sample_ranks,
    simulate_ranks,
    stage_group_problems,
    stage_group_view,
)


def expected_grid(plan: Plan, rank: int) -> dict | None:
    """x/y/z/data members of ``rank``'s 3D grid, computed from the layout (x fastest, then y, z)."""
    role = rank_roles(plan)[rank]
    stage = plan.replicas[role.replica].stages[role.stage]
    if stage.tp_grid is None:
        return None
    (gx, gy, gz), off, g = stage.tp_grid, stage.ranks[0], rank - stage.ranks[0]
    x, y, z = g % gx, g // gx % gy, g // (gx * gy)
    return {"x": tuple(off + i + gx * (y + gy * z) for i in range(gx)),
            "y": tuple(off + x + gx * (j + gy * z) for j in range(gy)),
            "z": tuple(off + x + gx * (y + gy * k) for k in range(gz)), "data": (rank,)}


def stage_and_grid_view(plan: Plan) -> dict:
    view = stage_group_view(plan)
    grid = create_plan_grid_groups(plan, timeout=TIMEOUT)
    view["grid"] = None if grid is None else {a: tuple(dist.get_process_group_ranks(grid.group(a)))
                                              for a in ("x", "y", "z", "data")}
    return view


@pytest.fixture(scope="module")
def plan():
    return uneven_plan()


def test_sampled_ranks_get_their_stage_and_grid_groups_and_create_the_same_groups_in_order(plan, monkeypatch):
    ranks = sample_ranks(plan)
    assert plan.world_size == 480 and len(ranks) <= 12
    sims = simulate_ranks(plan, ranks, stage_and_grid_view, monkeypatch)
    assert [p for sim in sims.values() for p in stage_group_problems(plan, sim)] == []
    assert {r: s.result["grid"] for r, s in sims.items()} == {r: expected_grid(plan, r) for r in ranks}
    assert sum(s.result["grid"] is not None for s in sims.values()) >= 2  # the sample reaches 3D stages
    assert creation_order_mismatch(sims) is None
    calls = sims[ranks[0]].creations
    stage_calls = [c[0] for c in calls[:len(calls) - 12 * B_COUNT] if len(c[0]) > 1]  # then 12 per grid
    assert stage_calls == expected_multi_rank_groups(plan)
    assert {c[2] for c in calls} == {TIMEOUT}


@pytest.mark.slow
def test_every_rank_gets_its_groups_and_creates_the_same_groups_in_order(plan, monkeypatch):
    """All 480 ranks (~0.3 s each), in batches compared with rank 0 (a batch's calls are kept in memory)."""
    ref = None
    for first in range(0, plan.world_size, 60):
        sims = simulate_ranks(plan, range(first, first + 60), stage_and_grid_view, monkeypatch)
        ref = ref or sims[0]
        assert [p for sim in sims.values() for p in stage_group_problems(plan, sim)] == []
        assert {r: s.result["grid"] for r, s in sims.items()} == {r: expected_grid(plan, r) for r in sims}
        assert creation_order_mismatch({0: ref, **sims}) is None
