"""A mixed NVIDIA/AMD pair of nodes (issue 14 item 6; docs/gpu.md, "Two nodes, two vendors").

Run the same command on both nodes at once: node rank 0 must be the NVIDIA node (CUDA torch), node
rank 1 the AMD node (ROCm torch), two GPUs each; MEGATRON_HET_MIXED_RDZV=host:port names node 0
(reachable from node 1) and MEGATRON_HET_MIXED_NODE_RANK this node's rank. The plan puts each
replica's two stages on different vendors (boundaries cross) and the two replicas' copies of every
layer on different vendors (gradient groups cross): everything across islands goes through the
bridge, NCCL and RCCL stay inside their node. Both nodes resume from a start checkpoint each makes on
its CPU with the same command; node 0 compares the printed losses with its own one-GPU reference
(1e-4 relative, fp32: cuBLAS and rocBLAS GEMMs round differently, and two CPUs may round the start
checkpoint's one step differently in the last bit).
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_het.plan import Plan, ReplicaPlan, StagePlan

from support.gpu_run import assert_close, need_gpus, pretrain, reference_losses, start_checkpoint, write_cluster

pytestmark = pytest.mark.gpu
RDZV = os.environ.get("MEGATRON_HET_MIXED_RDZV")
ISLANDS = [("nv", "A100-80GB", 2), ("amd", "MI250X", 2)]


def mixed_plan() -> Plan:
    """Each replica's boundary crosses the vendors, and so does each layer's gradient group."""
    def s(ranks, layers):
        nv = ranks[0] < 2  # torchrun gives node 0 global ranks 0-1, node 1 ranks 2-3
        return StagePlan(island="nv" if nv else "amd", device_type="A100-80GB" if nv else "MI250X",
                         ranks=tuple(ranks), layers=layers)

    return Plan(replicas=(ReplicaPlan(stages=(s([0], (0, 2)), s([2], (2, 4))), num_micro_batches=3),
                          ReplicaPlan(stages=(s([3], (0, 2)), s([1], (2, 4))), num_micro_batches=1)),
                micro_batch_size=2, global_batch_size=8, precision="fp32")
NODE_RANK = int(os.environ.get("MEGATRON_HET_MIXED_NODE_RANK", "0"))


def test_nvidia_and_amd_nodes_train_together(tmp_path_factory):
    need_gpus(2)
    if not RDZV:
        pytest.skip("no second vendor: set MEGATRON_HET_MIXED_RDZV=host:port and MEGATRON_HET_MIXED_NODE_RANK "
                    "on an NVIDIA node (rank 0) and an AMD node (rank 1); see docs/gpu.md")
    rocm = torch.version.hip is not None
    if rocm != (NODE_RANK == 1):
        pytest.skip(f"node rank {NODE_RANK} must be the {'AMD' if NODE_RANK else 'NVIDIA'} node, this one is "
                    f"{'AMD (ROCm)' if rocm else 'NVIDIA (CUDA)'}")
    tmp = tmp_path_factory.mktemp("mixed")
    shared = tmp_path_factory.mktemp("reference")
    start = start_checkpoint(shared, "fp32")  # each node makes it on its CPU: the same state on both
    ref = reference_losses(shared, "fp32") if NODE_RANK == 0 else None
    mixed_plan().save(tmp / "plan.json")
    cluster = write_cluster(tmp / "cluster.json", ISLANDS)
    run = pretrain(2, cluster, tmp / "plan.json", nnodes=2, node_rank=NODE_RANK, rdzv=RDZV, load=start)
    if NODE_RANK == 0:
        assert "groups across them use the het bridge" in run.output, run.output[-3000:]
        assert_close("NVIDIA + AMD nodes", run.losses, ref, 1e-4)
