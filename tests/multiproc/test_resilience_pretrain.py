"""``pretrain_gpt.py --hetero-resilience``: a SIGKILLed rank is covered by peers of another layout.

Six pretrain_gpt.py processes (the environment torchrun gives them: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) train a plan whose replicas cut the 8 layers differently: replica 0 = [0,4) [4,8),
replica 1 = [0,2) [2,6) [6,8), replica 2 = [0,8). The resilience store runs in this test process
(what ``python -m megatron_het.cli.resilience_store`` does for the launchers). Rank 0 (replica 0,
layers 0-4) SIGKILLs itself in iteration 2 after one action: no surviving stage holds layers 0-4,
so the union of replica 1's [0,2) and [2,6) (running only 2-4 for those micro-batches, handing the
activation on at layer 2) covers it. Checked against a failure-free run of the same command
(without the flag): every loss equal within fp32 round-off (5e-5 relative: ``LOSS_RTOL``), the covering
peers named in the log, every sample of every global batch embedded and scored exactly once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_het.plan import Plan, ReplicaPlan, StagePlan, save_plan
from megatron_het.platform.local_launch import free_port
from megatron_het.resilience.launch import serve_store

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "pretrain_scripts" / "pretrain_gpt.py"
ITERS, MBS, GBS = 4, 2, 12
# The resilient run computes the lost stage's micro-batches in another replica's layout: another fp32
# summation grouping. Measured 2026-11-29 (worst relative loss difference of the 4 iterations): 4.7e-6
# on this machine's AVX2 kernels, 7.6e-6 with ATen's scalar kernels (ATEN_CPU_CAPABILITY=default), 4.7e-6
# with oneDNN at SSE4.1 and MKL_CBWR=COMPATIBLE, 1.2e-5 on another machine (issue #39); ranks run one
# thread each (resilience/launch.py). 5e-5 is 4x the worst; a micro-batch lost or counted twice moves
# a loss by about 1/6 of it (and is caught by test_covering_peers_logged_and_every_sample_once).
LOSS_RTOL = 5e-5
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?\| lm loss: ([0-9.E+-]+)")
KILLED_RANK, KILLED_ITERATION = 0, 1  # 0-based iteration: the log's iteration 2 is redone


def uneven_plan() -> Plan:
    def stage(rank, layers):
        return StagePlan(island="cpu", device_type="CPU", ranks=(rank,), layers=layers)

    return Plan(replicas=(ReplicaPlan(stages=(stage(0, (0, 4)), stage(1, (4, 8))), num_micro_batches=2),
                          ReplicaPlan(stages=(stage(2, (0, 2)), stage(3, (2, 6)), stage(4, (6, 8))),
                                      num_micro_batches=2),
                          ReplicaPlan(stages=(stage(5, (0, 8)),), num_micro_batches=2)),
                micro_batch_size=MBS, global_batch_size=GBS)


def launch(tmp: Path, extra: list[str], *, timeout_s: float = 240) -> list[subprocess.CompletedProcess]:
    """Start the 6 ranks as torchrun would (one process each, env:// rendezvous), wait for all."""
    cluster = tmp / "cluster.yaml"
    cluster.write_text(json.dumps({"islands": [{"name": "cpu", "device": "CPU", "nodes": 1, "gpus_per_node": 6}]}))
    plan = tmp / "plan.json"
    save_plan(uneven_plan(), plan)
    argv = [sys.executable, str(PRETRAIN), "--hetero-cluster", str(cluster), "--hetero-plan", str(plan),
            "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--vocab-size", "200", "--micro-batch-size", str(MBS),
            "--global-batch-size", str(GBS), "--train-iters", str(ITERS), "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0",
            "--mock-data", "--no-emulation",
            # without dropout: a re-routed layer runs on another rank, whose dropout masks differ, and the
            # comparison with the failure-free run is exact only without them (Megatron's default is 0.1)
            "--hidden-dropout", "0", "--attention-dropout", "0", *extra]
    port = free_port()
    procs = []
    for rank in range(6):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="6", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def losses(stdout: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(stdout)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resilience_pretrain")
    reference = launch(tmp, [])
    assert all(r.returncode == 0 for r in reference), [r.stderr[-3000:] for r in reference if r.returncode][:1]
    store, address = serve_store()
    try:
        resilient = launch(tmp, ["--hetero-resilience", "--hetero-resilience-store", f"{address.host}:{address.port}",
                                 "--hetero-failure-timeout", "10", "--hetero-resilience-policy", "reroute",
                                 "--hetero-resilience-report", str(tmp / "report"),
                                 "--hetero-inject-fault", f"{KILLED_RANK}:{KILLED_ITERATION}:1"])
    finally:
        del store
    return reference, resilient, tmp / "report"


@pytest.mark.multiproc
@pytest.mark.slow
def test_killed_rank_dies_and_the_others_finish_without_restart(runs):
    _, resilient, _ = runs
    assert [r.returncode for r in resilient] == [-9, 0, 0, 0, 0, 0], [r.stderr[-2000:] for r in resilient]
    assert "resilience: ON" in resilient[0].stdout and "resilience: off" not in resilient[0].stdout  # rank 0 logs it


@pytest.mark.multiproc
@pytest.mark.slow
def test_losses_equal_the_failure_free_run(runs):
    reference, resilient, _ = runs
    ref = losses(reference[0].stdout)
    assert sorted(ref) == list(range(1, ITERS + 1)), reference[0].stdout[-2000:]
    assert "resilience: off" in reference[0].stdout
    # rank 0 logged until it died; then the new rank 0 (original rank 1) logs
    got = {**losses(resilient[0].stdout), **losses(resilient[1].stdout)}
    assert sorted(got) == list(range(1, ITERS + 1)), resilient[1].stdout[-3000:]
    worst = max(abs(got[it] - ref[it]) / abs(ref[it]) for it in ref)
    print(f"resilient vs failure-free: worst relative loss difference {worst:.2e} (limit {LOSS_RTOL:.0e}; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")
    for it in ref:
        assert abs(got[it] - ref[it]) <= LOSS_RTOL * abs(ref[it]), (it, got[it], ref[it])


@pytest.mark.multiproc
@pytest.mark.slow
def test_covering_peers_logged_and_every_sample_once(runs):
    _, resilient, report_dir = runs
    log = resilient[2].stderr
    assert "stage 0 of replica 0 (lost) -> replica 1 stage 0 (ranks [2]) runs global micro-batches [0, 1]" in log
    assert "stage 0 of replica 0 (lost) -> replica 1 stage 1 (ranks [3]) on layers 2-4 of its 2-6" in log
    reports = [json.loads((report_dir / f"rank{r}.json").read_text()) for r in range(1, 6)]
    assert [e["failed"] for e in reports[0]["events"]] == [[KILLED_RANK]]
    for kind, killed_share in (("embedded", range(0, 4)), ("scored", ())):
        for it in range(ITERS):
            seen = [s for rep in reports for s in rep[kind].get(str(it), ())]
            if it < KILLED_ITERATION:
                seen += list(killed_share)  # rank 0 (first stage of replica 0) completed these iterations
            assert sorted(seen) == list(range(GBS)), (kind, it, sorted(seen))
