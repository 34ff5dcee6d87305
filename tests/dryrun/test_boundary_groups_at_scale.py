"""Issue #19's 768-rank plan and the 480-rank uneven-TP plan: the pipeline boundaries' groups
(runtime/boundary_groups.py), created rank by rank on the fake backend as the trainer creates them.
Every sampled rank makes the same ``new_group`` calls in the same order (one per boundary), and holds
exactly the groups of its own boundaries: one per neighbouring stage, over both stages' ranks."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megatron_het.plan import load_any_plan, rank_roles
from megatron_het.runtime.boundary_groups import create_boundary_groups, group_with, plan_boundary_keys

from support.dryrun_plans import uneven_plan
from support.fake_world import TIMEOUT, creation_order_mismatch, sample_ranks, simulate_ranks

TANGRAM = load_any_plan(Path(__file__).parent / "tangram1024_llama2_7b_gbs2048.json")


def _view(plan):
    groups = create_boundary_groups(plan_boundary_keys(plan), spans_libraries=lambda ranks: False, backend=None,
                                    timeout=TIMEOUT)
    role = rank_roles(plan)[dist.get_rank()]
    stages = plan.replicas[role.replica].stages
    mine = tuple(stages[role.stage].ranks)
    out = {}
    for side, s in (("prev", role.stage - 1), ("next", role.stage + 1)):
        if 0 <= s < len(stages):
            g = group_with(stages[s].ranks, mine, groups)
            out[side] = (tuple(stages[s].ranks), {k: tuple(dist.get_process_group_ranks(v)) for k, v in g.items()})
    return {"held": len(groups), "sides": out}


def _check(plan, monkeypatch):
    ranks = sample_ranks(plan)
    sims = simulate_ranks(plan, ranks, _view, monkeypatch)
    assert creation_order_mismatch(sims) is None
    boundaries = sum(len(r.stages) - 1 for r in plan.replicas)
    for r, sim in sims.items():
        assert len(sim.creations) == boundaries  # every boundary, on every rank
        role = rank_roles(plan)[r]
        mine = tuple(plan.replicas[role.replica].stages[role.stage].ranks)
        sides = sim.result["sides"]
        assert sim.result["held"] == len(sides), (r, sim.result)
        for peer, members in sides.values():
            assert members == {"group": tuple(sorted((*mine, *peer)))}, (r, sides)
    return sims


def test_tangram_ranks_hold_their_boundaries_groups(monkeypatch):
    sims = _check(TANGRAM, monkeypatch)
    assert {len(s.result["sides"]) for s in sims.values()} == {1, 2}  # ends and middle stages sampled


def test_uneven_tp_ranks_hold_their_boundaries_groups(monkeypatch):
    _check(uneven_plan(), monkeypatch)
