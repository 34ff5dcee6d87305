"""Mixed precision as Megatron does it (issue 14): bf16 parity with megatron-core, fp16 loss scaling.

Reference: one process of plain megatron-core with Megatron-LM's --bf16 semantics: ``Float16Module``
(bf16 parameters and activations, fp32 per-token losses), DDP with fp32 gradient buffers and
``Float16OptimizerWithFloat16Params`` (fp32 main parameters, Adam on them, copied back to bf16).
Each heterogeneous plan starts from the reference's initial bf16 weights and runs the same 5
iterations in bf16 through this runtime (Float16Module per stage, fp32 main gradients reduced over
holders, fp32 main parameters).

Tolerance, bf16: relative 1e-3 on each of the 5 losses (measured: at most 5.4e-5). bf16 keeps 8
significant bits (unit round-off 2^-9 = 2e-3 per rounding); a TP split changes the order of the
partial sums of every GEMM and all-reduce, so single roundings of activations differ, but the losses
are fp32 means over 512 tokens and the weights move by fp32 Adam steps on fp32 main parameters, so
the loss differences stay far below one bf16 rounding. 1e-3 is half a bf16 rounding and a fifth of
the loss decrease of one step (~5e-3 relative), so a missing reduction, a gradient counted twice or
half-precision accumulation would fail it. The max difference is printed.
"""

from __future__ import annotations

import math

import pytest

from megatron_het.checkpoint.full_state import assemble_full_state
from megatron_het.model.groups import BlockShape
from megatron_het.platform.local_launch import run_local
from megatron_het.train.config import TrainConfig

from support.parity_plans import BRIDGED, BRIDGED_CLUSTER, CASES, CROSS_VENDOR_BOUNDARIES, MODEL, PADDED_VOCAB
from workers.megatron_workers import megatron_block_worker
from workers.precision_workers import precision_cases_worker

BF16 = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=5, lr=1e-3, bf16=True)
FP16 = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=20, lr=1e-3, fp16=True,
                   initial_loss_scale=2.0 ** 24, loss_scale_window=5, hysteresis=1)
BF16_RTOL = 1e-3


@pytest.fixture(scope="module")
def runs():
    ref = run_local(1, megatron_block_worker, (MODEL, BF16, BlockShape(tp=1, pp=1, dp=1), None, PADDED_VOCAB))[0]
    init = assemble_full_state([ref.initial_shards])
    cases = [(name, p, BF16, None) for name, p in CASES.items()]
    cases += [("bridged_nv_amd", BRIDGED, BF16, BRIDGED_CLUSTER),
              ("cross_vendor_boundaries", CROSS_VENDOR_BOUNDARIES, BF16, BRIDGED_CLUSTER),
              ("fp16_pp2tp2x3_pp1tp4x1", CASES["pp2tp2x3_pp1tp4x1"], FP16, None)]
    per_rank = run_local(8, precision_cases_worker, (MODEL, cases, init, PADDED_VOCAB))
    return ref, per_rank


@pytest.mark.parametrize("name", [*CASES, "bridged_nv_amd", "cross_vendor_boundaries"])
def test_bf16_plans_match_megatron_core_bf16(runs, name):
    ref, per_rank = runs
    want = [log.lm_loss for log in ref.iterations]
    got = [log.lm_loss for log in per_rank[0][name][0].iterations]
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    print(f"{name}: bf16 losses {[f'{g:.5f}' for g in got]} vs megatron-core bf16 {[f'{w:.5f}' for w in want]}; "
          f"max relative difference {worst:.2e}")
    assert len(got) == 5 and worst <= BF16_RTOL
    assert got[-1] < got[0]  # it trains


def test_bridged_bf16_routes_gradient_groups_through_the_bridge(runs):
    _, per_rank = runs
    kinds = {kind for rank in per_rank for _, kind in rank["bridged_nv_amd"][1]}
    assert "het-bridge" in kinds
    comm = [rank["cross_vendor_boundaries"][2] for rank in per_rank]
    assert all(c["boundary_bridge_bytes"] > 0 for c in comm), [c["boundary_bridge_bytes"] for c in comm]
    assert comm[0]["paths"]["pipeline boundaries"] == {"native": 0, "het-bridge": 2}


def test_fp16_loss_scaling_trains_and_reports_skipped_steps(runs):
    _, per_rank = runs
    logs = per_rank[0]["fp16_pp2tp2x3_pp1tp4x1"][0].iterations
    losses = [log.lm_loss for log in logs]
    skipped = [log.iteration for log in logs if log.skipped]
    scales = [log.loss_scale for log in logs]
    print(f"fp16: losses {[f'{x:.4f}' for x in losses]}; skipped iterations {skipped}; scales {scales}")
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    # 2^24 overflows fp16 (max 65504) in the output layer's gradient: the first step is skipped
    assert skipped and skipped[0] == 1 and scales[0] == 2.0 ** 24
    assert scales[-1] < scales[0]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.05  # the loss goes down once steps are taken
    assert all(rank["fp16_pp2tp2x3_pp1tp4x1"][0].iterations[i].skipped == logs[i].skipped
               for rank in per_rank for i in range(20))  # every rank agrees on which steps were skipped
