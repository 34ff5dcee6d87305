"""Two islands on one node, one forced through the bridge (issue 14 item 6; docs/gpu.md).

The cluster file labels some of this node's GPUs as another vendor's device (MI250X next to A100,
or the reverse on an AMD node), so every group spanning the two islands (pipeline boundaries with
2 GPUs, gradient groups with 4) must take the ``het`` bridge (host-staged gloo) although NCCL
could connect them. The start-up log must say so, and the losses (from the parity tests' start
checkpoint) must still match one GPU (fp32, 1e-5 relative: the bridge moves exact bytes, only the
reduction order changes).
"""

from __future__ import annotations

import re

import pytest

from megatron_het.plan import Plan, ReplicaPlan, StagePlan

from support.gpu_run import (
    assert_close,
    native_device,
    need_gpus,
    pretrain,
    reference_losses,
    start_checkpoint,
    write_cluster,
)

pytestmark = pytest.mark.gpu


def _other_vendor() -> str:
    return "A100-80GB" if native_device() == "MI250X" else "MI250X"


def _stage(ranks, layers, island):
    dev = native_device() if island == "native" else _other_vendor()
    return StagePlan(island=island, device_type=dev, ranks=tuple(ranks), layers=layers)


# GPUs -> (GPUs per island, replicas). 2: one pipeline whose stage boundary crosses islands;
# 4: a TP2 replica on one island, a PP2 replica on the other (gradient groups cross).
def _case(gpus):
    if gpus == 2:
        return (1, 1), [((_stage([0], (0, 2), "native"), _stage([1], (2, 4), "forced")), 4)]
    return (2, 2), [((_stage([0, 1], (0, 4), "native"),), 3),
                    ((_stage([2], (0, 2), "forced"), _stage([3], (2, 4), "forced")), 1)]


@pytest.mark.parametrize("gpus", [2, 4])
def test_forced_bridge_island_matches_one_gpu(tmp_path_factory, gpus):
    need_gpus(gpus)
    (n_native, n_forced), replicas = _case(gpus)
    tmp = tmp_path_factory.mktemp(f"bridge{gpus}")
    shared = tmp_path_factory.mktemp("reference")
    ref = reference_losses(shared, "fp32")
    Plan(replicas=tuple(ReplicaPlan(stages=s, num_micro_batches=m) for s, m in replicas), micro_batch_size=2,
         global_batch_size=8, precision="fp32").save(tmp / "plan.json")
    cluster = write_cluster(tmp / "cluster.json", [("native", native_device(), n_native),
                                                  ("forced", _other_vendor(), n_forced)])
    # the forced island is labelled as the other vendor's device: a stand-in on purpose
    run = pretrain(gpus, cluster, tmp / "plan.json", "--hetero-device-stand-in", load=start_checkpoint(shared, "fp32"))
    assert "the plan spans collective libraries ['nccl', 'rccl']" in run.output, run.output[-3000:]
    crossing = "pipeline boundaries" if gpus == 2 else "gradient groups"  # what crosses the islands
    assert re.search(rf"{crossing}: \d+ native \(\w+\), [1-9]\d* het-bridge", run.output), run.output[-3000:]
    assert_close(f"bridged islands on {gpus} GPUs", run.losses, ref, 1e-5)
