"""The float64 truth behind the fp32 parity tests' parameter check (issues #16 and #20).

One spawn runs the single-process megatron-core fp32 reference of tests/multiproc/test_schedules_parity.py
(6 layers, 6 micro-batches of 2, 5 AdamW steps at lr 1e-3, clip 1.0) and replays it in float64
(workers/f64_workers.py: the same GPTModel built in float64, the same initial state, batches, loss
averaging, clipping and AdamW). Checked here:

- the harness: every module output in float64; its 5 losses equal the fp32 reference's within 1e-5
  relative (measured 7.7e-8); with micro-batches of 1 instead of 2 (the same samples) its final
  parameters equal within 1e-11 relative norm per tensor (measured 1.0e-13): float64 is a truth for fp32.
- the fp32 floor: the reference's own distance to the truth, 1.2e-6 over all parameters together and up
  to 1.5e-4 per tensor (layer norm and qkv biases: small norms). Per tensor it is noisy: a matrix can land
  at 9.5e-7 in one fp32 run and 8e-6 in another, so "within 2x of the reference per tensor" would reject
  correct runs.
- the criterion of support/param_diff.py (TruthComparison.violations): over all parameters at most 4x the
  reference's distance, per tensor at most 20x max(the reference's distance of that tensor, over all).
  Another fp32 run as accurate as the reference (the reference with micro-batches of 1) passes it
  (measured 1.26x over all, per tensor at most 1.56x); it fails when one micro-batch's gradient of the
  last step is dropped (783x over all), when a qkv weight's learning rate is 1% off (86x over all, 1159x on
  the tensor) and when the noisiest bias's learning rate is 1% off (7.05x over all, 65x on the tensor).
  The parity tests' correct runs measured 0.51x..1.15x over all and at most 6.7x per tensor, hence the
  factors 2 and 20 (between the correct runs and the weakest fault, with room on both sides). Remeasured
  2026-11-29 from seeded starts (#34): the reference with micro-batches of 1, 1.00x; faults 2220x, 227x
  and 15.9x over all (the bias: 16246x on its tensor); correct parity runs up to 2.23x across machines and
  CPU kernels (#39), hence 4x over all now (support/param_diff.py says how it was measured).
- the same on the runtime itself (a two-stage pipeline, workers/f64_workers.lr_fault_hetero_worker): correct,
  1.00x over all (passes); a qkv weight's learning rate 1% off, 85.8x; the bias's, 7.11x over all and 64.9x
  on the tensor (both fail).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_het.checkpoint.full_state import assemble_full_state
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local
from megatron_het.train.config import TrainConfig

from support.param_diff import compare_to_truth, relative_norms
from support.parity_plans import MICRO_BATCH_SIZE
from support.schedule_plans import GLOBAL_BATCH_SIZE6, MODEL6, PADDED_VOCAB6
from workers.f64_workers import Fault, lr_fault_hetero_worker, reference_and_truth_worker

TRAIN = TrainConfig(micro_batch_size=MICRO_BATCH_SIZE, global_batch_size=GLOBAL_BATCH_SIZE6, train_iters=5, lr=1e-3)
FAULTS = {
    "drop_last_step_micro_batch_5": Fault(drop_micro_batch=(TRAIN.train_iters - 1, 5)),
    "lr_1pct_layer2_qkv_weight": Fault(lr_scale=("decoder.layers.2.self_attention.linear_qkv.weight", 1.01)),
    "lr_1pct_layer1_pre_mlp_norm_bias": Fault(lr_scale=("decoder.layers.1.pre_mlp_layernorm.bias", 1.01)),
}

# the runtime itself with the bug: two pipeline stages of one process each (1F1B, 6 micro-batches of 2)
PIPELINE2 = Plan(replicas=(ReplicaPlan(stages=(StagePlan(island="fast", device_type="CPU", ranks=(0,), layers=(0, 3)),
                                               StagePlan(island="fast", device_type="CPU", ranks=(1,), layers=(3, 6))),
                                       num_micro_batches=GLOBAL_BATCH_SIZE6 // MICRO_BATCH_SIZE),),
                 micro_batch_size=MICRO_BATCH_SIZE, global_batch_size=GLOBAL_BATCH_SIZE6)
RUNTIME_FAULTS = {"runtime_pp2": None, **{f"runtime_pp2_{k}": f.lr_scale for k, f in FAULTS.items() if f.lr_scale}}


@pytest.fixture(scope="module")
def runs():
    truths = {"truth": {}, "truth_mbs1": {"micro_batch_size": 1}, **{k: {"fault": f} for k, f in FAULTS.items()}}
    more = {"ref_mbs1": dataclasses.replace(TRAIN, micro_batch_size=1)}
    return run_local(1, reference_and_truth_worker, (MODEL6, TRAIN, PADDED_VOCAB6, truths, more))[0]


@pytest.mark.slow
@pytest.mark.multiproc
def test_float64_replay_is_a_truth_for_the_fp32_reference(runs):
    ref, out = runs
    truth = out["truth"]
    assert truth.dtypes == {torch.float64}, truth.dtypes  # no module casts down on the way
    want = [log.lm_loss for log in ref.iterations]
    worst = max(abs(a - b) / abs(b) for a, b in zip(truth.losses, want, strict=True))
    regrouped = relative_norms(out["truth_mbs1"].final, truth.final)
    loss_regrouped = max(abs(a - b) / abs(b) for a, b in zip(out["truth_mbs1"].losses, truth.losses, strict=True))
    print(f"float64 losses {truth.losses} vs fp32 {want}: max relative {worst:.2e}; float64 with micro-batches "
          f"of 1: params max {max(regrouped.values()):.2e}, losses {loss_regrouped:.2e}")
    assert worst <= 1e-5
    assert max(regrouped.values()) <= 1e-11 and loss_regrouped <= 1e-12


@pytest.mark.slow
@pytest.mark.multiproc
def test_criterion_accepts_an_fp32_run_and_rejects_faults(runs):
    ref, out = runs
    ref_final, truth = assemble_full_state([ref.shards]), out["truth"].final
    other = compare_to_truth(assemble_full_state([out["ref_mbs1"].shards]), ref_final, truth)
    print(other.summary("fp32 reference, micro-batches of 1"))
    assert other.violations() == [], other.violations()
    for name in FAULTS:
        bad = compare_to_truth(out[name].final, ref_final, truth)
        found = bad.violations()
        print(f"{bad.summary(name)}; {len(found)} violations, first: {found[:1]}")
        assert found, f"{name} passed the criterion"


@pytest.mark.slow
@pytest.mark.multiproc
def test_criterion_rejects_the_runtime_with_a_learning_rate_bug(runs):
    ref, out = runs
    ref_final, truth = assemble_full_state([ref.shards]), out["truth"].final
    init = assemble_full_state([ref.initial_shards])
    cases = [(name, PIPELINE2, lr_scale) for name, lr_scale in RUNTIME_FAULTS.items()]
    per_rank = run_local(2, lr_fault_hetero_worker, (MODEL6, cases, TRAIN, init, PADDED_VOCAB6))
    for name, lr_scale in RUNTIME_FAULTS.items():
        got = compare_to_truth(assemble_full_state([o[name] for o in per_rank if o[name]]), ref_final, truth)
        found = got.violations()
        print(f"{got.summary(name)}; {len(found)} violations, first: {found[:1]}")
        assert bool(found) == (lr_scale is not None), found  # the correct runtime passes, each bug fails
