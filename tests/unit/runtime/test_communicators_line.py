"""The start-up communicator line, and the GPU world group's device binding (issue #36, item 2)."""

from __future__ import annotations

import torch

from megatron_het.model.groups import group_options
from megatron_het.platform import Accelerator
from megatron_het.runtime.communicators import communicators_line


def test_one_count_or_the_range_and_the_rank_with_most():
    assert communicators_line([4, 4]).startswith("communicators per rank: 4 (")
    assert communicators_line([3, 7, 5]).startswith("communicators per rank: 3 to 7 (rank 1 has 7;")


def test_gpu_groups_are_created_eagerly_on_the_ranks_device():
    """A multi-rank GPU group gets ``device_id`` (NCCL creates its communicator when the group is made,
    members only, not inside a backward hook); the host none (gloo has no eager form)."""
    gpu = Accelerator(kind="cuda", device_count=8, torch_backend="nccl", device_name="H100",
                      device=torch.device("cuda", 3))
    cpu = Accelerator(kind="cpu", device_count=0, torch_backend="gloo", device_name="cpu")
    assert gpu.eager_device == torch.device("cuda", 3) and cpu.eager_device is None
    assert group_options(None, "nccl", gpu.eager_device) == {"backend": "nccl", "device_id": torch.device("cuda", 3)}
    assert group_options(None, "gloo", cpu.eager_device) == {"backend": "gloo"}
