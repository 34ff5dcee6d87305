"""The start-up communicator line, and the GPU world group's device binding (issue #36, item 2)."""

from __future__ import annotations

import torch

from megatron_het.platform import Accelerator
from megatron_het.runtime.communicators import communicators_line


def test_one_count_or_the_range_and_the_rank_with_most():
    assert communicators_line([4, 4]).startswith("communicators per rank: 4 (")
    assert communicators_line([3, 7, 5]).startswith("communicators per rank: 3 to 7 (rank 1 has 7;")


def test_a_gpu_world_group_is_bound_to_the_ranks_device():
    """device_id lets NCCL create the world communicator at once and split every later group from
    it in one world-wide order; the host gets no binding (gloo has none)."""
    gpu = Accelerator(kind="cuda", device_count=8, torch_backend="nccl", device_name="H100",
                      device=torch.device("cuda", 3))
    cpu = Accelerator(kind="cpu", device_count=0, torch_backend="gloo", device_name="cpu")
    assert gpu.init_process_group_options() == {"device_id": torch.device("cuda", 3)}
    assert cpu.init_process_group_options() == {}
