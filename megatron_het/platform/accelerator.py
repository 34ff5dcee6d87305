"""Which accelerator this process has (CUDA, ROCm/HIP or none), and everything that depends on it.

torch exposes ROCm through the ``torch.cuda`` API, so the vendor is told apart by
``torch.version.hip``. The :class:`Accelerator` is the one place that names devices and torch
backends: the device this rank's tensors live on (``cuda:LOCAL_RANK`` on GPUs, the host otherwise),
the backend of collectives inside an island (NCCL, RCCL through torch's ``nccl`` backend on ROCm,
gloo on CPU), the host backend of the cross-vendor bridge, device synchronisation, timing events
and memory statistics. Code outside ``platform/`` asks it instead of writing device or backend names.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import resource
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

HOST_DEVICE = torch.device("cpu")  # where host-staged copies (the bridge, checkpoints) live
HOST_BACKEND = "gloo"  # torch backend of host tensors: the bridge between vendors, CPU islands
GPU_BACKEND = "nccl"  # torch's name for NCCL, and for RCCL on ROCm builds
TORCH_BACKENDS = (GPU_BACKEND, HOST_BACKEND)  # what an island's collectives may run on
HOST_LIBRARY = "gloo"  # the collective library of CPU islands (catalog name; no cluster file: CPU)


@dataclass(frozen=True, kw_only=True)
class MemoryStats:
    """One rank's memory figures in bytes (GPU: torch's allocator; CPU: the process)."""

    max_allocated: int  # GPU: torch.cuda.max_memory_allocated; CPU: peak RSS
    max_reserved: int  # GPU: torch.cuda.max_memory_reserved; CPU: peak RSS
    current: int  # GPU: torch.cuda.memory_allocated; CPU: current RSS


class HostEvent:
    """A timing event on the host clock, with the interface of ``torch.cuda.Event(enable_timing=True)``."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        """Host events are complete when recorded."""

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to ``end`` (as torch.cuda.Event.elapsed_time)."""
        return (end.t - self.t) * 1000.0


def _rss_bytes() -> tuple[int, int]:
    """(peak, current) resident set size of this process."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        current = peak
    return peak, current


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """What this process computes on, and how its groups talk."""

    kind: str  # "cuda" (NVIDIA), "rocm" (AMD, HIP behind torch.cuda) or "cpu"
    device_count: int  # visible devices of that kind; 0 for "cpu"
    torch_backend: str  # torch.distributed backend for collectives inside an island: "nccl" or "gloo"
    device_name: str  # torch's name for device 0, or "cpu"
    # where this rank's tensors live: cuda:LOCAL_RANK on GPUs, the host otherwise (tests pass another
    # device object to catch tensors created elsewhere)
    device: torch.device = HOST_DEVICE

    @property
    def is_gpu(self) -> bool:
        return self.kind != "cpu"

    @property
    def vendor(self) -> str:
        """The catalog vendor whose devices this process drives: "nvidia", "amd" or "cpu"."""
        from megatron_het.cluster.catalog import AMD, HOST, NVIDIA

        return {"cuda": NVIDIA, "rocm": AMD}.get(self.kind, HOST)

    @property
    def host_backend(self) -> str:
        """Backend of host-staged traffic: the bridge between islands of different collective libraries."""
        return HOST_BACKEND

    @property
    def world_backend(self) -> str:
        """``init_process_group``'s backend: host objects on gloo, device tensors on the island's backend."""
        return HOST_BACKEND if not self.is_gpu else f"{HOST_DEVICE.type}:{HOST_BACKEND},{self.device.type}:{GPU_BACKEND}"

    @property
    def p2p_tags(self) -> bool:
        """Whether point-to-point tags select messages (gloo: yes; NCCL/RCCL ignore them and match
        sends and receives between a pair by issue order)."""
        return self.torch_backend != GPU_BACKEND

    def backend_for(self, library: str) -> str:
        """torch backend of a group among ranks that share ``library`` (a catalog collective library):
        this process's native backend (NCCL on NVIDIA, RCCL through torch's ``nccl`` on ROCm, gloo on
        the host). Groups spanning libraries never get here: they go through the bridge."""
        del library  # one library per group: it is this rank's own, whose backend is torch_backend
        return self.torch_backend

    def island_backends(self, libraries: Mapping[str, str]) -> dict[str, str]:
        """island -> torch backend, from island -> collective library."""
        return {island: self.backend_for(lib) for island, lib in libraries.items()}

    @property
    def eager_device(self) -> torch.device | None:
        """``new_group(device_id=)`` of this rank's multi-rank GPU groups: NCCL/RCCL then create each
        communicator when the group is made (members only, in the one world-wide creation order), not
        at its first collective, which may run inside a backward hook in each rank's own order. None
        on the host. The world group is deliberately not bound (``init_process_group(device_id=)``):
        every later group would become a world-wide split of one NCCL communicator, which cannot span
        NVIDIA and AMD ranks and desynchronises when the bridge creates gloo subgroups."""
        return self.device if self.is_gpu else None

    def set_device(self) -> None:
        """Bind this process to its device (before any process group is created)."""
        if self.is_gpu:
            torch.cuda.set_device(self.device)

    def synchronize(self) -> None:
        """Wait for the device's queued work (a no-op on the host)."""
        if self.is_gpu:
            torch.cuda.synchronize(self.device)

    def event(self):
        """A timing event: a CUDA/HIP event on GPUs (read after the work), the host clock otherwise."""
        if self.is_gpu:
            return torch.cuda.Event(enable_timing=True)
        return HostEvent()

    def memory(self) -> MemoryStats:
        if self.is_gpu:
            return MemoryStats(max_allocated=int(torch.cuda.max_memory_allocated(self.device)),
                               max_reserved=int(torch.cuda.max_memory_reserved(self.device)),
                               current=int(torch.cuda.memory_allocated(self.device)))
        peak, current = _rss_bytes()
        peak = max(peak, current)  # the OS peak may lag a current sample
        return MemoryStats(max_allocated=peak, max_reserved=peak, current=current)


def island_group_backend(native: str) -> str:
    """Backend string of an island's group inside the bridge: host tensors always on gloo, device
    tensors on the island's native backend (where this host has a GPU and NCCL)."""
    import torch.distributed as dist

    if native == GPU_BACKEND and torch.cuda.is_available() and dist.is_nccl_available():
        return f"{HOST_DEVICE.type}:{HOST_BACKEND},cuda:{GPU_BACKEND}"
    return HOST_BACKEND  # CPU-only host: the island's device tensors are host tensors here


def backend_devices() -> list[str]:
    """Device types a custom torch backend (the ``het`` bridge) registers for on this host."""
    return [HOST_DEVICE.type] + (["cuda"] if torch.cuda.is_available() else [])


LOCAL_RANK_OVERRIDE = "MEGATRON_HET_LOCAL_RANK"  # set by the resilient sbatch: one torchrun agent per rank


def local_rank() -> int:
    """This process's index on its node: ``MEGATRON_HET_LOCAL_RANK`` where the launcher starts one
    torchrun agent per rank (the resilient sbatch: each agent's LOCAL_RANK is 0), else torchrun's
    LOCAL_RANK; 0 without either."""
    return int(os.environ.get(LOCAL_RANK_OVERRIDE) or os.environ.get("LOCAL_RANK", "0"))


def detect_accelerator(rank_on_node: int | None = None) -> Accelerator:
    """Inspect torch for a usable GPU; never raises. The device is ``cuda:LOCAL_RANK`` (modulo the
    visible devices) on a GPU, the host otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        count = torch.cuda.device_count()
        mine = local_rank() if rank_on_node is None else rank_on_node
        if mine >= count:  # more ranks than visible GPUs on this node: they share (oversubscribed)
            logger.warning("local rank %d >= %d visible GPUs: sharing cuda:%d (check --nproc-per-node and "
                           "CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)", mine, count, mine % count)
        index = mine % count
        return Accelerator(kind=kind, device_count=count, torch_backend=GPU_BACKEND,
                           device_name=torch.cuda.get_device_name(index),
                           device=torch.device("cuda", index))
    return Accelerator(kind="cpu", device_count=0, torch_backend=HOST_BACKEND, device_name="cpu", device=HOST_DEVICE)


@dataclass(frozen=True, kw_only=True)
class OptionalAccelerators:
    """Optional GPU libraries megatron-core can use; absent ones fall back to local code."""

    transformer_engine: bool  # TE layer spec and fused kernels; else megatron-core's local spec
    apex: bool  # apex fused optimizers/layernorm; else torch's
    triton: bool  # triton kernels (MoE paged stash); else megatron_het's import guard

    def describe(self) -> str:
        te = "transformer-engine layer spec" if self.transformer_engine else "megatron-core local layer spec"
        opt = "apex fused Adam" if self.apex else "torch Adam"
        return f"{te}; {opt}; triton {'present' if self.triton else 'absent (import guard active)'}"


def detect_optional_accelerators(accelerator: Accelerator | None = None) -> OptionalAccelerators:
    """transformer-engine and apex only count on a GPU: their CPU wheels do nothing useful."""
    acc = accelerator or detect_accelerator()

    def importable(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    return OptionalAccelerators(
        transformer_engine=acc.is_gpu and importable("transformer_engine"),
        apex=acc.is_gpu and importable("apex"),
        triton=importable("triton"),
    )
