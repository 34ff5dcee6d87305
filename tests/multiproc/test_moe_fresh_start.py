"""A Megatron-LM MoE user's fresh run (#37): Mixtral's MoE flags as its example script writes them,
through pretrain_gpt.py from the seed alone, on real tokenized data, under TP2 (sequence parallel)
x PP2. The losses equal the single-process megatron-core run of the same flags within 1e-5
relative (fp32; bf16 1e-3 against its bf16 run, as the dense suites), the loss goes down, every iteration line carries the routers' load-balancing
loss, and the holders' check agrees at the start and the end."""

from __future__ import annotations

import dataclasses
import re

import pytest
from test_fresh_start import (  # noqa: F401 (common: the fixture)
    BF16_RTOL,
    CPU4,
    ITERS,
    PADDED_VOCAB,
    RTOL,
    TP2PP2,
    _argv,
    common,
)

from megatron_het.platform.local_launch import run_local

from workers.fresh_workers import fresh_start_worker, reference_worker

# examples/mixtral/train_mixtral_8x7b_distributed.sh's MOE_ARGS (8 experts shrunk to 4), with its
# --disable-bias-linear and --swiglu; sequence parallelism as its MODEL_PARALLEL_ARGS (MoE under TP needs it)
MIXTRAL_MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
               "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
               "--disable-bias-linear", "--swiglu")


@pytest.mark.multiproc
def test_mixtral_moe_flags_train_the_single_process_model_under_tp2_pp2(common):  # noqa: F811
    def reference(*extra):
        return [log.lm_loss for log in run_local(1, reference_worker, (_argv(common, *MIXTRAL_MOE, *extra),
                                                                      PADDED_VOCAB))[0].iterations]

    ref, ref_bf16 = reference(), reference("--bf16")
    plan = dataclasses.replace(TP2PP2, sequence_parallel=True)  # what --sequence-parallel makes of the plan
    bf16 = dataclasses.replace(plan, precision="bf16")
    out = run_local(4, fresh_start_worker, ([("tp2pp2_moe", plan, CPU4, list(MIXTRAL_MOE)),
                                             ("tp2pp2_moe_bf16", bf16, CPU4, [*MIXTRAL_MOE, "--bf16"])], common),
                    timeout_s=900)[0]
    assert out["tp2pp2_moe_bf16"]["losses"] == pytest.approx(ref_bf16, rel=BF16_RTOL)
    run = out["tp2pp2_moe"]
    assert run["losses"] == pytest.approx(ref, rel=RTOL), (run["losses"], ref)
    assert run["losses"][-1] < run["losses"][0]
    balance = [float(v) for v in re.findall(r"\| load_balancing_loss: ([0-9.E+-]+) ", run["log"])]
    assert len(balance) == ITERS and all(0.5 < v < 4 for v in balance), run["log"][-2000:]  # 1 when balanced
    assert "--moe-grouped-gemm True is ignored" in run["log"]
    assert f"weight check after iteration {ITERS}: every holder agrees" in run["log"]
