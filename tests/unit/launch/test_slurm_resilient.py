"""The Slurm job of a --hetero-resilience run: a dead rank does not end the job step."""

from __future__ import annotations

import re
import subprocess

from megatron_het.cluster import load_cluster
from megatron_het.launch import JobOptions, het_components, render_sbatch
from megatron_het.plan import Plan

from support.paths import REPO

CPU_DEMO = "examples/clusters/cpu-demo.yaml"
CPU_PLAN = "examples/plans/cpu-demo-hetero.json"


def _script(*training_args: str) -> str:
    comps = het_components(load_cluster(REPO / CPU_DEMO), Plan.load(REPO / CPU_PLAN), {})
    return render_sbatch(comps, JobOptions(cluster_file=CPU_DEMO, plan_file=CPU_PLAN,
                                           training_args=("--mock-data", *training_args)))


def test_off_by_default_keeps_the_fail_fast_job():
    text = _script()
    assert "--kill-on-bad-exit=1" in text and "resilience_store" not in text and "--max-restarts" not in text


def test_resilient_job_survives_a_dead_rank():
    text = _script("--hetero-resilience")
    assert "--kill-on-bad-exit=1" not in text and text.count("--kill-on-bad-exit=0") == 2  # both components
    assert "--nproc-per-node=1 --max-restarts=0" in text
    assert '-m megatron_het.cli.resilience_store --host "$MASTER_ADDR" --port "$RESILIENCE_PORT" &' in text
    assert 'TRAIN+=(--hetero-resilience-store "$MASTER_ADDR:$RESILIENCE_PORT")' in text
    assert "stopping the others" not in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_every_rank_gets_its_own_agent_with_its_global_rank(tmp_path):
    """Run the per-node command with a torchrun stand-in that prints its node rank: component 1 of
    cpu-demo (2 ranks on one node, first global rank 2) starts agents 2 and 3 of 4 rendezvous nodes."""
    text = _script("--hetero-resilience")
    node_cmd = re.search(r"^NODE_CMD=('.*')$", text, re.M).group(1)
    fake = tmp_path / "torchrun"
    fake.write_text('#!/bin/bash\necho "agent local=$MEGATRON_HET_LOCAL_RANK $*"\n')
    fake.chmod(0o755)
    script = f"NODE_CMD={node_cmd}\nbash -c \"$NODE_CMD\" torchrun script.py --flag\n"
    env = {"TORCHRUN": str(fake), "NNODES": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1", "SLURM_JOB_ID": "7",
           "SLURM_NODEID": "0", "MEGATRON_HET_NPROC": "2", "MEGATRON_HET_FIRST_RANK": "2", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(["bash", "-c", script], env=env, text=True, capture_output=True, check=True).stdout
    ranks = sorted(int(m) for m in re.findall(r"--node-rank=(\d+)", out))
    assert ranks == [2, 3], out
    # each agent's LOCAL_RANK is 0 (one process each): the index on the node picks the GPU (not all cuda:0)
    assert sorted(re.findall(r"agent local=(\d+) ", out)) == ["0", "1"], out
    assert out.count("--nnodes=4 --nproc-per-node=1 --max-restarts=0") == 2 and "script.py --flag" in out
    assert "MEGATRON_HET_FIRST_RANK=2" in text


def test_the_launchers_local_rank_wins_over_torchruns(monkeypatch):
    from megatron_het.platform.accelerator import LOCAL_RANK_OVERRIDE, local_rank

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv(LOCAL_RANK_OVERRIDE, raising=False)
    assert local_rank() == 0
    monkeypatch.setenv(LOCAL_RANK_OVERRIDE, "3")
    assert local_rank() == 3


def test_the_node_launcher_gives_each_agent_its_device(tmp_path):
    """pretrain_scripts/resilient_torchrun.sh (the launchers' --hetero-resilience path): run with a
    torchrun stand-in, each of a node's agents gets its own MEGATRON_HET_LOCAL_RANK (without it,
    every rank of the node took cuda:0) and its global rank as the rendezvous node rank."""
    fake = tmp_path / "torchrun"
    fake.write_text('#!/bin/bash\necho "agent local=$MEGATRON_HET_LOCAL_RANK $*"\n')
    fake.chmod(0o755)
    env = {"TORCHRUN": str(fake), "NNODES": "2", "NODE_RANK": "1", "GPUS_PER_NODE": "3", "MASTER_ADDR": "h",
           "MASTER_PORT": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(["bash", str(REPO / "pretrain_scripts/resilient_torchrun.sh"), "script.py", "--flag"],
                         env=env, text=True, capture_output=True, check=True).stdout
    agents = sorted((int(m.group(2)), int(m.group(1))) for m in
                    re.finditer(r"agent local=(\d+) .*--node-rank=(\d+)", out))
    assert agents == [(3, 0), (4, 1), (5, 2)], out
    assert out.count("--hetero-resilience-store h:2") == 3 and out.count("--nnodes=6 ") == 3, out
