"""Uneven sharding arithmetic, the ShardedPlan type and the flat-shard AdamW (no processes)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_het.sharding import FlatIndex, RankShare, ShardedPlan, ShardLayout, sample_ranges, shard_sizes
from megatron_het.sharding.optimizer import ShardedAdamW, decay_runs
from megatron_het.train.config import TrainConfig


def _plan(mbs=(1, 1, 2, 4), nmb=(1, 1, 1, 1), fr=(0.1, 0.2, 0.3, 0.4), gbs=8):
    return ShardedPlan(ranks=tuple(RankShare(rank=i, island="a", device_type="CPU", micro_batch_size=mbs[i],
                                             num_micro_batches=nmb[i], shard_fraction=fr[i]) for i in range(4)),
                       global_batch_size=gbs)


def test_shard_sizes_follow_fractions_and_sum_exactly():
    assert shard_sizes(1000, (0.1, 0.2, 0.3, 0.4)) == (100, 200, 300, 400)
    sizes = shard_sizes(1001, (1 / 3, 1 / 3, 1 / 3))
    assert sum(sizes) == 1001 and sizes == (334, 334, 333)
    assert shard_sizes(10, (0.0, 1.0)) == (0, 10)


def test_shard_sizes_reject_fractions_not_summing_to_one():
    with pytest.raises(ValueError, match=r"shard_fractions: must sum to 1 \(got 0.900000000"):
        shard_sizes(100, (0.5, 0.4))


def test_layout_ranges_and_segments_cut_parameters_at_shard_boundaries():
    layout = ShardLayout.from_fractions(10, (0.3, 0.7))
    assert layout.range(0) == (0, 3) and layout.range(1) == (3, 10) and layout.max_size == 7
    index = FlatIndex(names=("a", "b"), numels=(4, 6))
    segs = index.segments(*layout.range(0))
    assert [(s.name, s.param_start, s.shard_start, s.numel) for s in segs] == [("a", 0, 0, 3)]
    segs = index.segments(*layout.range(1))
    assert [(s.name, s.param_start, s.shard_start, s.numel) for s in segs] == [("a", 3, 0, 1), ("b", 0, 1, 6)]


def test_sample_ranges_are_consecutive_in_rank_order():
    assert sample_ranges((1, 1, 2, 4)) == (range(0, 1), range(1, 2), range(2, 4), range(4, 8))


def test_plan_json_round_trip_and_derived_views():
    plan = _plan()
    again = ShardedPlan.from_json(plan.to_json())
    assert again == plan
    assert again.samples_per_rank == (1, 1, 2, 4) and again.shard_fractions == (0.1, 0.2, 0.3, 0.4)
    assert json.loads(plan.to_json())["format"] == "megatron-het-sharded-plan"


def test_plan_validation_names_field_value_and_fix():
    with pytest.raises(ValueError, match=r"global_batch_size: the ranks compute 8 samples per iteration, not global_batch_size \(got 9\)\. Fix"):
        _plan(gbs=9)
    with pytest.raises(ValueError, match=r"shard_fraction: the ranks' fractions sum to 1\.100000000"):
        _plan(fr=(0.2, 0.2, 0.3, 0.4))
    with pytest.raises(ValueError, match=r"ranks\[2\]\.micro_batch_size: must be an integer >= 1 \(got 0\)"):
        RankShare(rank=2, island="a", device_type="CPU", micro_batch_size=0, num_micro_batches=1, shard_fraction=0.5)
    with pytest.raises(ValueError, match=r"ranks\[1\]\.rank: must equal its position 1 \(got 0\)"):
        ShardedPlan(ranks=(RankShare(rank=0, island="a", device_type="CPU", micro_batch_size=1, num_micro_batches=1,
                                     shard_fraction=0.5),) * 2, global_batch_size=2)


def test_flat_shard_adamw_equals_torch_adamw_across_a_shard_boundary():
    """Two shards (3 | 9 elements) cut the weight matrix; together they must equal torch's AdamW
    with Megatron's groups (decay on the 2-D weight, none on the bias)."""
    torch.manual_seed(0)
    w, b = torch.randn(2, 4), torch.randn(4)
    train = TrainConfig(micro_batch_size=1, global_batch_size=1, train_iters=1, lr=1e-2, weight_decay=0.1)
    ref_w, ref_b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())
    ref = torch.optim.AdamW([{"params": [ref_w], "weight_decay": 0.1}, {"params": [ref_b], "weight_decay": 0.0}],
                            lr=1e-2, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps, foreach=False)
    index = FlatIndex(names=("x.weight", "x.bias"), numels=(8, 4))
    shapes = {"x.weight": (2, 4), "x.bias": (4,)}
    layout = ShardLayout.from_fractions(12, (0.25, 0.75))
    flat = torch.cat([w.reshape(-1), b])
    opts = [ShardedAdamW(master=flat[lo:hi].clone(), runs=decay_runs(index, shapes, lo, hi), train=train)
            for lo, hi in (layout.range(0), layout.range(1))]
    assert [(r.start, r.stop, r.decays) for r in opts[0].runs] == [(0, 3, True)]
    assert [(r.start, r.stop, r.decays) for r in opts[1].runs] == [(0, 5, True), (5, 9, False)]
    for step in range(3):
        gw, gb = torch.randn(2, 4), torch.randn(4)
        ref_w.grad, ref_b.grad = gw.clone(), gb.clone()
        ref.step()
        g = torch.cat([gw.reshape(-1), gb])
        for opt, (lo, hi) in zip(opts, (layout.range(0), layout.range(1))):
            opt.step(g[lo:hi], 1e-2)
    ours = torch.cat([o.master for o in opts])
    theirs = torch.cat([ref_w.detach().reshape(-1), ref_b.detach()])
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-7), (ours - theirs).abs().max()
    assert opts[1].step_count == 3
