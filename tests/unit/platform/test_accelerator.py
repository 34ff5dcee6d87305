"""The accelerator object: device, backends, events and memory (issue 14), on this CPU host and as
a GPU process would see them (constructed, not detected)."""

from __future__ import annotations

import torch

from megatron_het.platform import HOST_BACKEND, HOST_DEVICE, Accelerator, detect_accelerator
from megatron_het.train.timer import EmulationTimer


def _gpu(kind="cuda", index=3):
    return Accelerator(kind=kind, device_count=8, torch_backend="nccl", device_name="x",
                       device=torch.device("cuda", index))


def test_cpu_host():
    acc = detect_accelerator(rank_on_node=5)
    assert acc.device == HOST_DEVICE and acc.torch_backend == HOST_BACKEND and acc.world_backend == HOST_BACKEND
    assert acc.p2p_tags and acc.backend_for("rccl") == HOST_BACKEND
    m = acc.memory()
    assert 0 < m.current <= m.max_allocated == m.max_reserved  # RSS on CPU


def test_gpu_backends_as_constructed():
    acc = _gpu("rocm")
    assert acc.is_gpu and acc.device == torch.device("cuda", 3)
    assert acc.backend_for("rccl") == "nccl" and acc.backend_for("nccl") == "nccl"  # RCCL is torch's nccl
    assert acc.host_backend == HOST_BACKEND
    assert acc.world_backend == "cpu:gloo,cuda:nccl"  # host objects on gloo, device tensors native
    assert not acc.p2p_tags  # NCCL matches p2p by order: the runtime checks schedules for it


def test_timer_reads_events_once_per_step():
    acc = detect_accelerator()
    timer = EmulationTimer(events=acc.event)
    timer.compute(lambda: sum(range(20000)))
    timer.compute(lambda: sum(range(20000)))
    assert len(timer._pending) == 2  # recorded, not read: no synchronisation per forward/backward
    first = timer.compute_s
    assert first > 0 and not timer._pending and timer.compute_s == first
    timer.reset()
    assert timer.compute_s == 0.0
