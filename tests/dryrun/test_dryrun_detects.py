"""The dry-run tier can fail: deliberate bugs in group construction, each caught by its check.

1. A rank that creates only the groups it belongs to (a tempting shortcut) still ends up with correct
   groups, so a per-rank check passes, but its ``new_group`` calls differ from other ranks' and a real
   launch would hang: ``creation_order_mismatch`` must name the rank and the first differing call.
2. Grid dimension names out of step with the grid's shape give the stage's ranks to the wrong group:
   ``stage_group_problems`` must report it.
3. The gradient synchronizer's version of 1: a rank that creates only the bucket groups it reduces
   (``new_reduction_group`` skipped elsewhere) keeps the right groups, but ``creation_order_mismatch``
   must catch the differing calls.
4. A synchronizer that plans its buckets from its own holdings (a gather that lost the other ranks)
   creates no groups at all, the same on every rank, so only ``grad_sync_problems`` can tell: its
   buckets miss every parameter it holds.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid

import megatron_het.runtime.comm_routing as comm_routing
import megatron_het.runtime.stage_groups as stage_groups
from megatron_het.cluster import ModelSpec
from megatron_het.plan import homogeneous_plan
from megatron_het.runtime.grad_sync import plan_buckets
from megatron_het.runtime.holdings import plan_holdings

from support.fake_grad_sync import answer_gather_with, by_rank, grad_sync_problems, grad_sync_view
from support.fake_world import (
    TIMEOUT,
    creation_order_mismatch,
    simulate_ranks,
    stage_group_problems,
    stage_group_view,
)

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200)


def test_a_rank_that_skips_other_stages_groups_is_caught(monkeypatch):
    plan = homogeneous_plan(tp=2, pp=2, dp=64, num_layers=4, micro_batch_size=1, global_batch_size=64)
    real = HyperCommGrid.get_rank_enum

    def only_mine(grid, dims):  # the shortcut: no group this rank is not part of
        return [ranks for ranks in real(grid, dims) if dist.get_rank() in ranks]

    monkeypatch.setattr(HyperCommGrid, "get_rank_enum", only_mine)
    last = plan.world_size - 1
    sims = simulate_ranks(plan, [0, last], stage_group_view, monkeypatch)
    assert [p for sim in sims.values() for p in stage_group_problems(plan, sim)] == []  # groups look right
    mismatch = creation_order_mismatch(sims)
    # as many calls on both ranks (2: its own stage's TP group and its own), but different first groups
    assert mismatch is not None and mismatch.startswith(
        f"rank {last} made 2 new_group calls, rank 0 2; call 0 differs: rank 0 ((0, 1), None,")
    assert f"rank {last} (({last - 1}, {last}), None," in mismatch


def test_grid_dimension_names_out_of_step_with_its_shape_are_caught(monkeypatch):
    plan = homogeneous_plan(tp=4, pp=2, dp=32, num_layers=4, micro_batch_size=1, global_batch_size=64)
    monkeypatch.setattr(stage_groups, "GRID_DIMS", ("cp", "tp", "ep", "dp", "pp"))  # shape is [tp, 1, 1, 1, 1]
    sims = simulate_ranks(plan, [5], stage_group_view, monkeypatch)
    problems = stage_group_problems(plan, sims[5])
    assert "rank 5: tp group (5,) != its stage's ranks (4, 5, 6, 7)" in problems
    assert "rank 5: cp group (4, 5, 6, 7) != (5,)" in problems


def _grad_sync_world():
    plan = homogeneous_plan(tp=2, pp=2, dp=8, num_layers=4, micro_batch_size=1, global_batch_size=8)
    gathered = by_rank(plan_holdings(plan, MODEL), plan.world_size)
    return plan, gathered, plan_buckets([h for hs in gathered for h in hs])


def test_a_rank_that_skips_buckets_it_does_not_reduce_is_caught(monkeypatch):
    plan, gathered, expected = _grad_sync_world()
    real = comm_routing.new_reduction_group

    def only_mine(ranks, placement, **kwargs):
        if dist.get_rank() not in ranks:
            return None  # the shortcut: no group this rank does not reduce
        return real(ranks, placement, **kwargs)

    monkeypatch.setattr(comm_routing, "new_reduction_group", only_mine)
    answer_gather_with(monkeypatch, gathered)
    last = plan.world_size - 1
    sims = simulate_ranks(plan, [0, last], grad_sync_view(gathered, timeout=TIMEOUT), monkeypatch)
    assert [p for r, sim in sims.items() for p in grad_sync_problems(r, sim.result, expected)] == []
    mismatch = creation_order_mismatch(sims)
    # 6 buckets: one per stage and TP rank, and the tied embedding's per TP rank over both stages;
    # each rank creates the 2 it reduces, and the first already differs
    assert len(expected) == 6 and mismatch is not None
    assert mismatch.startswith(f"rank {last} made 2 new_group calls, rank 0 2; call 0 differs: rank 0 ((0, ")


def test_buckets_planned_from_a_ranks_own_holdings_are_caught(monkeypatch):
    plan, gathered, expected = _grad_sync_world()
    lost = [[] for _ in gathered]

    def own_only(out, obj, group=None):
        out[:] = lost
        out[dist.get_rank()] = list(obj)

    answer_gather_with(monkeypatch, gathered)  # the rank's local holdings are checked, then:
    monkeypatch.setattr(dist, "all_gather_object", own_only)
    sims = simulate_ranks(plan, [0, 5], grad_sync_view(gathered, timeout=TIMEOUT), monkeypatch)
    assert creation_order_mismatch(sims) is None  # no groups anywhere: nothing differs
    problems = grad_sync_problems(5, sims[5].result, expected)
    assert problems[0] == "rank 5: planned 0 buckets, plan_buckets gives 6"
    assert problems[-1].startswith("rank 5: its buckets miss ['decoder.layers.0.input_layernorm.bias'")
