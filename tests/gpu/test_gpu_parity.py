"""Heterogeneous plans on real GPUs train like one GPU (issue 14 item 6; docs/gpu.md).

Each plan runs through ``torchrun pretrain_gpt.py`` on one island of this node's GPUs (NCCL, or RCCL
through torch's ``nccl`` backend on ROCm): 1, 2, 4 and 8 GPUs as available, the 8-GPU plans being
tests/multiproc/test_runtime_parity.py's. Every run resumes from one checkpoint (made on the CPU
after one iteration: a plan's own initial weights depend on its stage split) and trains 5 more
iterations; each printed loss must match the single-GPU reference (one stage, same global batch):
- fp32: 1e-5 relative, as on CPU (the same arithmetic up to reduction order; the log prints 7 digits);
- bf16 (``--bf16``: bf16 weights and activations, fp32 main parameters and gradient reduction):
  1e-3 relative, as tests/multiproc/test_mixed_precision.py on CPU. bf16's epsilon is 2^-8 = 3.9e-3
  (one rounding errs by up to half of it), but the loss is an fp32 mean over 512 tokens and the
  weights move by fp32 Adam steps on fp32 main parameters, so a TP or PP split's different roundings
  largely average out: the CPU dry run of this harness measured 5.6e-6 (pp2, dp2_uneven_3_1), the CPU
  TP plans of test_mixed_precision 5.4e-5. 1e-3 keeps a 20x margin over those and is a quarter of
  one bf16 epsilon.
The 1-GPU case checks the GPU against the CPU run of the same command (fp32, 1e-3: other GEMM
kernels, and TF32 where a library turns it on, round differently).
"""

from __future__ import annotations

import math
import re

import pytest

from megatron_het.plan import Plan, ReplicaPlan, StagePlan

from support.gpu_run import (
    LOSS,
    assert_close,
    cpu_only,
    native_device,
    need_gpus,
    precision_flags,
    pretrain,
    reference_losses,
    start_checkpoint,
    write_cluster,
)

pytestmark = pytest.mark.gpu


def _plan(precision, *replicas, dev=None):
    dev = dev or native_device()
    return Plan(replicas=tuple(ReplicaPlan(stages=tuple(StagePlan(island="gpu", device_type=dev, ranks=tuple(r),
                                                                  layers=layers) for r, layers in stages),
                                           num_micro_batches=m) for stages, m in replicas),
                micro_batch_size=2, global_batch_size=8, precision=precision)


# name -> (GPUs, replicas as ([(ranks, layers), ...], micro-batches)); 4 micro-batches of 2 in all
PLANS = {
    "pp2": (2, [([([0], (0, 2)), ([1], (2, 4))], 4)]),
    "dp2_uneven_3_1": (2, [([([0], (0, 4))], 3), ([([1], (0, 4))], 1)]),
    "tp2_tp1_tp1": (4, [([([0, 1], (0, 1)), ([2], (1, 3)), ([3], (3, 4))], 4)]),
    "pp2x3_tp2x1": (4, [([([0], (0, 3)), ([1], (3, 4))], 3), ([([2, 3], (0, 4))], 1)]),
    "tp2pp1_tp4pp1_tp2pp1": (8, [([([0, 1], (0, 1)), ([2, 3, 4, 5], (1, 3)), ([6, 7], (3, 4))], 4)]),
    "pp2tp2x3_pp1tp4x1": (8, [([([0, 1], (0, 3)), ([2, 3], (3, 4))], 3), ([([4, 5, 6, 7], (0, 4))], 1)]),
    "tp1_tp2_tied_x3": (8, [([([0], (0, 2)), ([1, 2], (2, 4))], 2), ([([3], (0, 1)), ([4, 5], (1, 4))], 1),
                            ([([6], (0, 3)), ([7], (3, 4))], 1)]),
}
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3}
SKIPPED = re.compile(r"number of skipped iterations: +(\d+)")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(PLANS))
def test_plan_matches_one_gpu(tmp_path_factory, name, precision):
    gpus, replicas = PLANS[name]
    need_gpus(gpus)
    tmp = tmp_path_factory.mktemp(f"{name}-{precision}")
    shared = tmp_path_factory.mktemp("reference")
    ref = reference_losses(shared, precision)
    _plan(precision, *replicas).save(tmp / "plan.json")
    cluster = write_cluster(tmp / "cluster.json", [("gpu", native_device(), gpus)])
    run = pretrain(gpus, cluster, tmp / "plan.json", *precision_flags(precision),
                   load=start_checkpoint(shared, precision))
    assert "communication: one collective library" in run.output, run.output[-3000:]
    assert_close(f"{name} {precision} on {gpus} GPUs", run.losses, ref, TOLERANCE[precision])


def test_one_gpu_matches_cpu(tmp_path):
    need_gpus(1)
    ref = reference_losses(tmp_path, "fp32")
    # The same command with no GPU visible: the accelerator falls back to the CPU and gloo.
    with cpu_only():
        _plan("fp32", ([([0], (0, 4))], 4), dev="CPU").save(tmp_path / "plan.json")
        cluster = write_cluster(tmp_path / "cpu-cluster.json", [("gpu", "CPU", 1)])
        cpu = pretrain(1, cluster, tmp_path / "plan.json", load=start_checkpoint(tmp_path, "fp32"))
    assert "accelerator: cpu" in cpu.output, cpu.output[-3000:]
    assert_close("1 GPU vs CPU (fp32)", ref, cpu.losses, 1e-3)


def test_fp16_loss_scaling_trains(tmp_path):
    """--fp16 with dynamic loss scaling, 20 iterations on one GPU from the plan's own initial weights:
    every loss finite, the log carries the loss scale and counts skipped (overflowed) steps, iteration
    1 (same weights) equals the fp32 run of the same command within fp16's epsilon (9.8e-4) and every
    later loss within 1e-2 (the skipped steps leave the weights a few Adam steps behind: the CPU dry run
    measured 5e-7 and 2.4e-3). The mock data are uniform random tokens, so the loss sits at ln(512)
    from the start and cannot be asked to go down here."""
    need_gpus(1)
    cluster = write_cluster(tmp_path / "cluster.json", [("gpu", native_device(), 1)])
    runs = {}
    for precision in ("fp16", "fp32"):
        _plan(precision, ([([0], (0, 4))], 4)).save(tmp_path / f"{precision}.json")
        runs[precision] = pretrain(1, cluster, tmp_path / f"{precision}.json", *precision_flags(precision), iters=20)
    fp16 = runs["fp16"]
    lines = [line for line in fp16.output.splitlines() if LOSS.search(line)]
    skipped = [int(m.group(1)) for line in lines for m in [SKIPPED.search(line)] if m]
    print(f"fp16 losses {fp16.losses}; skipped per log line {skipped}")
    assert all(math.isfinite(v) for v in fp16.losses), fp16.losses
    assert all("| loss scale: " in line for line in lines), lines[:2]
    assert len(skipped) == len(lines) and sum(skipped) >= 1, skipped  # the initial scale overflows fp16
    assert_close("fp16 vs fp32, iteration 1", fp16.losses[:1], runs["fp32"].losses[:1], 9.8e-4)
    assert_close("fp16 vs fp32 (1 GPU, 20 iterations)", fp16.losses, runs["fp32"].losses, 1e-2)
