"""docs/gpu.md's first job (section 5) on one node of 8 GPUs: the doc's own commands, run as written.

The commands are read from the doc (tests/support/first_job.py), so this runs what a reader types after
starting the container: the data commands, the planner on the node's cluster file
(``examples/clusters/h100-8.yaml`` on NVIDIA, ``mi250x-8.yaml`` on ROCm), then ``python -m
torch.distributed.run --standalone --nproc-per-node 8 pretrain_scripts/pretrain_gpt.py ...``: Llama-2-7B,
bf16, 20 iterations of 64 x 4096 tokens, ``--save``. Passes when every iteration logs a finite loss, the
loss falls (the mean of the last 5 iterations at most 90% of iteration 1's, which starts near
ln 32000 = 10.4 for the random model), and the checkpoint of iteration 20 is complete and readable.

Where it runs: in ``MEGATRON_HET_FIRST_JOB_DIR`` (default: pytest's temporary directory), which needs
about 80 GB free for the checkpoint (fp32 weights and two Adam moments of 6.7 B parameters); the inputs
(examples/, tools/, pretrain_scripts/) are linked in, the outputs land under its runs/first-job/. Each
command may take ``MEGATRON_HET_FIRST_JOB_TIMEOUT`` seconds (default 3600: the MI250X plan is predicted
at 15 s per iteration, and start-up draws 6.7 B parameters on the host per rank, then the save writes
~75 GiB). Skips without 8 GPUs, with GPUs smaller than the cluster file's device, or without the disk.
The same commands are checked on CPU on every run by test_harness_on_cpu.py.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_het.cluster import load_cluster

from support import first_job
from support.gpu_run import LOSS, need_gpus
from support.paths import REPO

pytestmark = pytest.mark.gpu

TIMEOUT_S = float(os.environ.get("MEGATRON_HET_FIRST_JOB_TIMEOUT", "3600"))
DISK_GIB = 80  # the checkpoint is ~75 GiB (12 bytes per parameter), plus the data


def _run(argv: list[str], cwd: Path, what: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(first_job.subprocess_argv(argv), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{what}: `{shlex.join(argv)}` exited {proc.returncode}:\n{output[-6000:]}"
    return proc.stdout


def test_first_job_trains_and_saves(tmp_path):
    need_gpus(8)
    vendor = "amd" if torch.version.hip else "nvidia"
    recipe = first_job.recipe(vendor)
    device = load_cluster(REPO / recipe.flag(recipe.plan, "--cluster")).islands[0].device
    have_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    if have_gib < 0.95 * device.memory_gib:
        pytest.skip(f"the recipe's plan is for {device.name} ({device.memory_gib:g} GiB per GPU); GPU 0 has "
                    f"{have_gib:.1f} GiB")
    workdir = first_job.link_inputs(Path(os.environ.get("MEGATRON_HET_FIRST_JOB_DIR") or tmp_path))
    free_gib = shutil.disk_usage(workdir).free / 2**30
    if free_gib < DISK_GIB:
        pytest.skip(f"{workdir} has {free_gib:.0f} GiB free; the 7B checkpoint needs ~{DISK_GIB} GiB "
                    "(set MEGATRON_HET_FIRST_JOB_DIR)")
    save = workdir / recipe.flag(recipe.train_args, "--save")
    if save.exists():  # a reused MEGATRON_HET_FIRST_JOB_DIR: the checkpoint checked below must be this run's
        shutil.rmtree(save)

    for argv in recipe.data:
        _run(argv, workdir, "data")
    print(_run(recipe.plan, workdir, "plan"))
    stdout = _run(recipe.train, workdir, "train")

    iters = int(recipe.flag(recipe.train_args, "--train-iters"))
    losses = [float(m.group(2)) for m in LOSS.finditer(stdout)]
    print(f"first job on 8 GPUs ({vendor}): losses {losses}")
    assert len(losses) == iters, f"expected {iters} loss lines, got {len(losses)}:\n{stdout[-4000:]}"
    assert all(math.isfinite(x) for x in losses), losses
    last = sum(losses[-5:]) / 5
    assert last <= 0.9 * losses[0], f"the loss did not fall: iteration 1 {losses[0]}, mean of the last 5 {last}"

    from megatron_het.checkpoint.dist_ckpt import TRACKER, iteration_dir, read_common

    assert f"saved checkpoint {recipe.flag(recipe.train_args, '--save')}/iter_{iters:07d}" in stdout, stdout[-4000:]
    assert (save / TRACKER).read_text().strip() == str(iters)
    common = read_common(iteration_dir(str(save), iters))
    assert common["iteration"] == iters, common.get("iteration")
