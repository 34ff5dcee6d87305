"""The generated sbatch script on a real Slurm (22.05, two slurmd nodes on this machine).

scripts/slurm_localhost.sh starts slurmctld and slurmd n0 (partition p0) / n1 (partition p1); the
CPU demo cluster's island ``fast`` goes to p0 and ``slow`` to p1, so the job is a real two-component
heterogeneous job. Skipped (with the reason) when Slurm is absent and cannot be installed (that
needs root and CI=true) or the daemons do not come up.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_het.plan import RankShare, ShardedPlan

from support.paths import REPO

ROOT = REPO
SCRIPT = ROOT / "scripts" / "slurm_localhost.sh"
CLUSTER = ROOT / "examples" / "clusters" / "cpu-demo.yaml"
PLAN = ROOT / "examples" / "plans" / "cpu-demo-hetero.json"
MODEL = ROOT / "examples" / "models" / "tiny-cpu.yaml"  # slurm.py checks the plan against it
PRETRAIN = ROOT / "pretrain_scripts" / "pretrain_gpt.py"
DEMO_ARGS = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
             "--micro-batch-size 2 --global-batch-size 16 --train-iters 3 --lr 1e-3 --mock-data --vocab-size 512 "
             "--log-interval 1 --eval-iters 0").split()
# Records what torchrun gave this rank in <dir>/rank-<RANK>.txt (the job log interleaves lines of
# concurrent processes) and prints it, so the test can check every rank's place.
STAND_IN = """import os, sys
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MEGATRON_HET_ISLAND", "SLURMD_NODENAME")
line = "RANKINFO " + " ".join(f"{k}={os.environ.get(k)}" for k in keys) + " ARGS " + " ".join(sys.argv[1:])
out_dir = sys.argv[sys.argv.index("--rank-dir") + 1]
with open(os.path.join(out_dir, "rank-" + os.environ["RANK"] + ".txt"), "w") as f:
    f.write(line)
print(line, flush=True)
"""


def _can_install() -> bool:
    return os.geteuid() == 0 and os.environ.get("CI") == "true" and shutil.which("apt-get") is not None


def _free_port() -> int:
    # slurmd listen on port+10000 and port+10001; pick a ctld port whose neighbours are free as well.
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10001 > 65535:
            continue
        try:
            for p in (port + 10000, port + 10001):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    return 6817


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if sys.platform != "linux":
        pytest.skip("the localhost Slurm recipe is Linux-only")
    if shutil.which("slurmctld") is None and not _can_install():
        pytest.skip("Slurm is not installed (apt-get install slurmctld slurmd slurm-client); the test installs it "
                    "itself only as root with CI=true")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root (SlurmUser=root in scripts/slurm_localhost.sh)")
    state = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, SLURM_LOCALHOST_DIR=str(state / "slurm"), SLURM_LOCALHOST_PORT=str(_free_port()))
    started = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=600)
    if started.returncode != 0:
        pytest.skip(f"could not start slurmctld/slurmd: {started.stderr.strip()[-800:]}")
    env["SLURM_CONF"] = str(state / "slurm" / "slurm.conf")
    try:
        yield env, state
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, timeout=60)


def _submit(env: dict, workdir: Path, script: Path, training_args: list[str], timeout: float,
            plan: Path = PLAN) -> str:
    """Generate, submit with --wait, return the job's output (asserting it ran to the end)."""
    job = workdir / "job.sbatch"
    gen = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "slurm.py"), "--cluster", str(CLUSTER), "--plan", str(plan),
         "--model", str(MODEL), "--partition", "fast=p0", "--partition", "slow=p1", "--script", str(script), "--log", str(workdir / "job-%j.out"),
         "--output", str(job), "--", *training_args], capture_output=True, text=True, check=True)
    assert "wrote" in gen.stderr
    run_env = dict(env, TORCHRUN=f"{sys.executable} -m torch.distributed.run")
    t0 = time.monotonic()
    try:
        done = subprocess.run(["sbatch", "--wait", f"--chdir={ROOT}", str(job)], env=run_env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--name=megatron-het"], env=env, timeout=30)
        raise AssertionError(f"job did not finish in {timeout} s")
    m = re.search(r"Submitted batch job (\d+)", done.stdout)
    assert m, done.stdout + done.stderr
    outputs = list(workdir.glob(f"job-{m.group(1)}.out"))
    # A job cancelled while pending also makes `sbatch --wait` return 0: the output file must exist.
    assert outputs, f"no output file for job {m.group(1)} after {time.monotonic() - t0:.0f} s (never started?)"
    text = outputs[0].read_text()
    assert done.returncode == 0, f"job failed with {done.returncode}:\n{text[-3000:]}"
    return text


def _sharded_plan(path: Path) -> Path:
    """The demo cluster as one uneven sharded data-parallel group (ranks 0-1 fast, 2-3 slow)."""
    shares = tuple(RankShare(rank=r, island="fast" if r < 2 else "slow", device_type="CPU", micro_batch_size=2,
                             num_micro_batches=3 if r < 2 else 1, shard_fraction=0.25) for r in range(4))
    ShardedPlan(ranks=shares, global_batch_size=16).save(path)
    return path


@pytest.mark.parametrize("kind", ["pipeline", "sharded"])
def test_het_job_places_every_rank(slurm, tmp_path, kind):
    env, _ = slurm
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN)
    rank_dir = tmp_path / "ranks"
    rank_dir.mkdir()
    plan = PLAN if kind == "pipeline" else _sharded_plan(tmp_path / "sharded.json")
    text = _submit(env, tmp_path, stand_in, ["--rank-dir", str(rank_dir)], timeout=180, plan=plan)
    assert "2 components, 2 nodes, rendezvous 127.0.0.1:" in text
    assert text.count("RANKINFO ") == 4
    ranks = {}
    for path in sorted(rank_dir.glob("rank-*.txt")):
        line = path.read_text()
        info = dict(kv.split("=", 1) for kv in line.split(" ARGS ")[0].split()[1:])
        ranks[int(info["RANK"])] = info
        assert f"--hetero-cluster {CLUSTER} --hetero-plan {plan} --rank-dir {rank_dir}" in line
    assert sorted(ranks) == [0, 1, 2, 3]
    # fast = component 0 on n0 (node rank 0), slow = component 1 on n1 (node rank 1).
    got = {r: (i["MEGATRON_HET_ISLAND"], i["SLURMD_NODENAME"], i["GROUP_RANK"], i["LOCAL_RANK"], i["WORLD_SIZE"])
           for r, i in ranks.items()}
    assert got == {0: ("fast", "n0", "0", "0", "4"), 1: ("fast", "n0", "0", "1", "4"),
                   2: ("slow", "n1", "1", "0", "4"), 3: ("slow", "n1", "1", "1", "4")}


@pytest.mark.slow  # ~60 s: two torchrun agents, four ranks importing megatron-core, three iterations
@pytest.mark.skipif(not PRETRAIN.exists(), reason="pretrain_scripts/pretrain_gpt.py does not exist yet")
def test_het_job_trains_the_cpu_demo(slurm, tmp_path):
    env, _ = slurm
    text = _submit(env, tmp_path, PRETRAIN, DEMO_ARGS, timeout=300)
    iterations = [int(m.group(1)) for m in re.finditer(r"iteration\s+(\d+)/\s*3 \|", text)]
    assert iterations == [1, 2, 3], text[-3000:]
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", text)]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses)
    assert "slow(CPU) TP=2 ranks 2-3" in text
