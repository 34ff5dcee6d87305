"""A GPU island whose rank has no such GPU stops the job before anything is built (issue #36): a
CPU-only torch on a node of an NVIDIA + AMD cluster trained on the CPU, silently, before. Every rank
raises the same error, naming each rank and its island; --hetero-device-stand-in is the opt-in."""

from __future__ import annotations

import pytest

from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local

from workers.fresh_workers import device_check_worker

CLUSTER = """islands:
  - {name: nv, device: A100-80GB, nodes: 1, gpus_per_node: 1}
  - {name: amd, device: MI250X, nodes: 1, gpus_per_node: 1}
links:
  - {between: [nv, amd], bandwidth_gbps: 100}
"""
PLAN = Plan(replicas=(ReplicaPlan(stages=(StagePlan(island="nv", device_type="A100-80GB", ranks=(0,), layers=(0, 1)),
                                          StagePlan(island="amd", device_type="MI250X", ranks=(1,), layers=(1, 2))),
                                  num_micro_batches=2),),
            micro_batch_size=1, global_batch_size=2, precision="fp32")


@pytest.fixture
def argv(tmp_path):
    cluster = tmp_path / "nv-amd.yaml"
    cluster.write_text(CLUSTER)
    return ["--hetero-cluster", str(cluster), "--hetero-plan", "unused", "--num-layers", "2", "--hidden-size", "16",
            "--num-attention-heads", "2", "--seq-length", "8", "--max-position-embeddings", "8", "--vocab-size",
            "64", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", "--mock-data",
            "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1"]


@pytest.mark.multiproc
def test_cpu_processes_on_gpu_islands_stop_naming_each_rank(argv):
    errors = run_local(2, device_check_worker, (argv, PLAN))
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "2 of 2 ranks run on another vendor than their island's" in errors[0]
    assert "rank 0 is in island 'nv' (A100-80GB, nvidia) but this process's torch sees no GPU" in errors[0]
    assert "rank 1 is in island 'amd' (MI250X, amd)" in errors[0] and "--hetero-device-stand-in" in errors[0]


@pytest.mark.multiproc
def test_the_stand_in_flag_lets_them_train(argv):
    assert run_local(2, device_check_worker, ([*argv, "--hetero-device-stand-in"], PLAN)) == [None, None]
