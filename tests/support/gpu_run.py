"""Helpers of the GPU tier (tests/gpu/, docs/gpu.md): skip reasons that name what is missing, and a
launcher that runs pretrain_gpt.py under torchrun exactly as a user would, returning its printed losses.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from support.paths import REPO

PRETRAIN = REPO / "pretrain_scripts" / "pretrain_gpt.py"
MODEL_FILE = REPO / "examples" / "models" / "tiny-cpu.yaml"  # 4 layers, hidden 64, seq 64, vocab 512
# What train/loop.py prints once per --log-interval (7 significant digits).
LOSS = re.compile(r" iteration +(\d+)/ +\d+ \| consumed samples: +\d+ .*\| lm loss: ([0-9.E+-]+) \|")
TIMEOUT_S = float(os.environ.get("MEGATRON_HET_GPU_TEST_TIMEOUT", "900"))


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def need_gpus(n: int) -> None:
    """Skip, naming what is missing, unless this node has ``n`` GPUs visible to torch."""
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else (
            f"ROCm {torch.version.hip}" if torch.version.hip else "CPU-only")
        pytest.skip(f"no CUDA: torch {torch.__version__} ({build} build) sees no GPU")
    if gpu_count() < n:
        pytest.skip(f"fewer than {n} GPUs: {gpu_count()} visible (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)")


@dataclass(frozen=True)
class Run:
    losses: list[float]  # one per iteration (--log-interval 1)
    output: str  # stdout + stderr of every rank (rank 0 prints the log)


def write_cluster(path: Path, islands: list[tuple[str, str, int]]) -> Path:
    """A cluster file with islands (name, catalog device, GPUs on this node); no emulation block."""
    doc = {"islands": [{"name": n, "device": d, "nodes": 1, "gpus_per_node": g} for n, d, g in islands]}
    names = [n for n, _, _ in islands]
    doc["links"] = [{"between": [a, b], "bandwidth_gbps": 100} for i, a in enumerate(names) for b in names[i + 1:]]
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def pretrain(nproc: int, cluster: Path, plan_path: Path, *extra: str, iters: int = 5, micro: int = 2,
             global_batch: int = 8, nnodes: int = 1, node_rank: int = 0, rdzv: str | None = None,
             load: Path | None = None, model: Path = MODEL_FILE) -> Run:
    """torchrun pretrain_gpt.py on ``nproc`` local GPUs (per node); fails with the run's output tail.

    With ``load`` (a checkpoint of iteration 1), the run resumes from it and trains ``iters`` more.
    """
    if load is not None:
        extra = (*extra, "--load", str(load))
    total = iters + (1 if load is not None else 0)
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1:
        launcher.append("--standalone")
    else:
        launcher += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={rdzv.split(':')[0]}",
                     f"--master-port={rdzv.split(':')[1]}"]
    argv = ["--hetero-cluster", str(cluster), "--hetero-model", str(model), "--hetero-plan", str(plan_path),
            "--micro-batch-size", str(micro), "--global-batch-size", str(global_batch), "--train-iters", str(total),
            "--log-interval", "1", "--lr", "1e-3", "--mock-data", "--no-emulation", *extra]
    proc = subprocess.run([*launcher, str(PRETRAIN), *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"pretrain_gpt.py on {nproc} GPU(s) exited {proc.returncode}:\n{output[-6000:]}")
    losses = [float(m.group(2)) for m in LOSS.finditer(proc.stdout)]
    if node_rank == 0:
        assert len(losses) == iters, f"expected {iters} loss lines, got {len(losses)}:\n{proc.stdout[-4000:]}"
    return Run(losses=losses, output=output)


def assert_close(name: str, losses: list[float], ref: list[float], rel: float) -> None:
    assert len(losses) == len(ref), (name, losses, ref)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    print(f"{name}: losses {losses}; reference {ref}; worst relative difference {worst:.2e} (limit {rel:.0e})")
    for i, (a, b) in enumerate(zip(losses, ref)):
        assert abs(a - b) <= rel * abs(b), f"{name} iteration {i + 1}: {a} vs reference {b} (relative {rel})"


def native_device() -> str:
    """A catalog device of this node's vendor, so a one-island cluster's library matches the hardware."""
    return "MI250X" if torch.version.hip else "A100-80GB"


@contextlib.contextmanager
def cpu_only():
    """Hide every GPU from the processes started inside (the accelerator then picks the CPU and gloo)."""
    hide = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
    saved = {k: os.environ.get(k) for k in hide}
    os.environ.update({k: "" for k in hide})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def one_stage_plan(path: Path, precision: str, device: str) -> Path:
    """One rank, one stage with every layer, 4 micro-batches of 2."""
    from megatron_het.plan import Plan, ReplicaPlan, StagePlan

    Plan(replicas=(ReplicaPlan(stages=(StagePlan(island="gpu", device_type=device, ranks=(0,), layers=(0, 4)),),
                               num_micro_batches=4),),
         micro_batch_size=2, global_batch_size=8, precision=precision).save(path)
    return path


_CHECKPOINTS: dict[str, Path] = {}
_REFERENCES: dict[str, list[float]] = {}


def start_checkpoint(tmp: Path, precision: str) -> Path:
    """The state every compared run starts from: one CPU process, one iteration, saved.

    A plan's initial weights depend on its stage split and TP sizes (each owner stage is seeded on its
    own), so runs of different plans are compared from one loaded checkpoint (plan-independent) instead.
    Made on the CPU, so two nodes of different vendors make the same one from the same command.
    """
    if precision not in _CHECKPOINTS:
        plan = one_stage_plan(tmp / f"start-{precision}.json", precision, "CPU")
        cluster = write_cluster(tmp / "start-cluster.json", [("gpu", "CPU", 1)])
        with cpu_only():
            pretrain(1, cluster, plan, *precision_flags(precision), "--save", str(tmp / f"start-{precision}"),
                     iters=1)
        _CHECKPOINTS[precision] = tmp / f"start-{precision}"
    return _CHECKPOINTS[precision]


def reference_losses(tmp: Path, precision: str) -> list[float]:
    """Losses of the single-process reference from the start checkpoint: one GPU, one stage with every
    layer (computed once per precision per pytest process)."""
    if precision not in _REFERENCES:
        need_gpus(1)
        plan = one_stage_plan(tmp / f"reference-{precision}.json", precision, native_device())
        cluster = write_cluster(tmp / "reference-cluster.json", [("gpu", native_device(), 1)])
        _REFERENCES[precision] = pretrain(1, cluster, plan, *precision_flags(precision),
                                          load=start_checkpoint(tmp, precision)).losses
    return _REFERENCES[precision]


def precision_flags(precision: str) -> list[str]:
    """Megatron's flags for a plan precision: fp32 is no flag."""
    return {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16"]}[precision]
