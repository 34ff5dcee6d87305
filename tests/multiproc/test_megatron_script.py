"""A Megatron-LM style command line, launched by torchrun as a user would, with only --hetero-cluster
added: Megatron's layout flags build the plan, and the run trains exactly what the same layout given
as a plan file trains (from the seed, no supplied state)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.gpu_run import LOSS
from support.paths import REPO

PRETRAIN = os.path.join(REPO, "pretrain_scripts/pretrain_gpt.py")
ITERS = 6
MEGATRON_FLAGS = [  # spelled as Megatron-LM's examples/gpt3 scripts spell them, sizes shrunk
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "16",
    "--train-iters", str(ITERS), "--lr", "3e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "1", "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0",
    "--init-method-std", "0.02", "--attention-dropout", "0", "--hidden-dropout", "0", "--bf16",
    "--use-flash-attn", "--no-masked-softmax-fusion", "--distributed-backend", "nccl",
    "--log-interval", "1", "--eval-iters", "0", "--mock-data", "--vocab-size", "512",
]
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--decoder-first-pipeline-num-layers", "3"]


def _torchrun(argv: list[str]) -> tuple[list[float], str]:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           PRETRAIN, "--hetero-cluster", os.path.join(REPO, "examples/clusters/cpu-demo.yaml"),
                           "--no-emulation", *argv], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return [float(m.group(2)) for m in LOSS.finditer(proc.stdout)], proc.stdout


@pytest.mark.multiproc
def test_megatron_flags_train_what_the_same_plan_file_trains():
    flags_losses, out = _torchrun(MEGATRON_FLAGS + LAYOUT)
    file_losses, _ = _torchrun(MEGATRON_FLAGS + ["--hetero-plan", os.path.join(REPO, "examples/plans/"
                                                                              "cpu-demo-hetero.json")])
    assert len(flags_losses) == ITERS and flags_losses == file_losses, (flags_losses, file_losses)
    assert flags_losses[-1] < flags_losses[0] - 0.05, flags_losses  # Megatron's mock data is learnable
    assert "plan: Megatron-LM's layout from the flags (no --hetero-plan): TP 2 x PP 2 x DP 1" in out
    for flag in ("--use-flash-attn", "--no-masked-softmax-fusion"):  # --distributed-backend nccl: the default
        assert f"note: {flag} " in out, flag


@pytest.mark.multiproc
def test_megatron_dropout_is_applied_under_tensor_parallelism():
    """--hidden/--attention-dropout reach megatron-core's layers (the losses move off the dropout-free
    run's) and a TP=2 x PP=2 run with them trains, every holder of each parameter in agreement
    (checked every iteration)."""
    plain, _ = _torchrun(MEGATRON_FLAGS + LAYOUT)
    dropped, out = _torchrun(MEGATRON_FLAGS + LAYOUT + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1",
                                                        "--check-weight-hash-across-dp-replicas-interval", "1"])
    assert len(dropped) == ITERS and dropped != plain, (dropped, plain)
    assert dropped[-1] < dropped[0] - 0.05, dropped
