"""The dry-run tier can fail: two deliberate bugs in group construction, each caught by its check.

1. A rank that creates only the groups it belongs to (a tempting shortcut) still ends up with correct
   groups, so a per-rank check passes, but its ``new_group`` calls differ from other ranks' and a real
   launch would hang: ``creation_order_mismatch`` must name the rank and the first differing call.
2. Grid dimension names out of step with the grid's shape give the stage's ranks to the wrong group:
   ``stage_group_problems`` must report it.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid

import megatron_het.runtime.stage_groups as stage_groups
from megatron_het.plan import homogeneous_plan

from support.fake_world import creation_order_mismatch, simulate_ranks, stage_group_problems, stage_group_view


def test_a_rank_that_skips_other_stages_groups_is_caught(monkeypatch):
    plan = homogeneous_plan(tp=2, pp=2, dp=64, num_layers=4, micro_batch_size=1, global_batch_size=64)
    real = HyperCommGrid.create_pg

    def only_mine(grid, dims, **kwargs):
        if dist.get_rank() not in range(grid.rank_offset, grid.rank_offset + grid.size):
            return None  # the shortcut: no group this rank is not part of
        return real(grid, dims, **kwargs)

    monkeypatch.setattr(HyperCommGrid, "create_pg", only_mine)
    last = plan.world_size - 1
    sims = simulate_ranks(plan, [0, last], stage_group_view, monkeypatch)
    assert [p for sim in sims.values() for p in stage_group_problems(plan, sim)] == []  # groups look right
    mismatch = creation_order_mismatch(sims)
    # as many calls on both ranks (14: its own stage's), but each creates a different first group
    assert mismatch is not None and mismatch.startswith(
        f"rank {last} made 14 new_group calls, rank 0 14; call 0 differs: rank 0 ((0, 1), None,")
    assert f"rank {last} (({last - 1}, {last}), None," in mismatch


def test_grid_dimension_names_out_of_step_with_its_shape_are_caught(monkeypatch):
    plan = homogeneous_plan(tp=4, pp=2, dp=32, num_layers=4, micro_batch_size=1, global_batch_size=64)
    monkeypatch.setattr(stage_groups, "GRID_DIMS", ("cp", "tp", "ep", "dp", "pp"))  # shape is [tp, 1, 1, 1, 1]
    sims = simulate_ranks(plan, [5], stage_group_view, monkeypatch)
    problems = stage_group_problems(plan, sims[5])
    assert "rank 5: tp group (5,) != its stage's ranks (4, 5, 6, 7)" in problems
    assert "rank 5: cp group (4, 5, 6, 7) != (5,)" in problems
