"""Profile the devices as a run sees them: measured by the run's own ranks, together, on their emulated devices.

A profile measured by one process minutes before a run prices what that process saw then. When several
emulated devices share a host's cores, the CPU time of the same computation is larger in the run (caches,
memory bandwidth and the host's other load are shared, and that load drifts minute to minute;
bench/schedules.py, 2026-11-25: one-process profile 1/1.10..1/1.50 of the 4-rank run's CPU time per action).
The honest profile of a device is measured where and when the job runs on it, as a user profiles the GPUs a
job is given:

- :func:`profile_in_rank` is called by every rank of the run's torch.distributed world, in the run's
  processes, just before its timed iterations. Each rank measures the layers, stage parts, AdamW step, B/W
  split and chunk-call overhead (``profile_layers``) on its own (no barrier per repetition: its pipeline
  actions do not start together either) and, after every timed section, waits what its emulated device
  would need on top ((slowdown - 1) x the measured time, as EmulationTimer does), so the ranks share the
  host as they do when they train.
- :func:`median_profile` combines the ranks' profiles (and several spawns' ones) into one profile of the
  device type: every measured figure is the median over the profiles. The performance model reads it
  through the usual Profile / ``load_profile`` path and prices every schedule from it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_het.cluster import ModelSpec
from megatron_het.perf.profile import Profile
from megatron_het.profiling.combine import median_profile

__all__ = ["profile_in_rank", "median_profile"]  # median_profile: profiling/combine.py


def profile_in_rank(model: ModelSpec, *, slowdown: float, num_layers: int, micro_batch_sizes: list[int],
                    device: str, warmup: int, repeats: int, dtype: torch.dtype = torch.float32,
                    vocab_size: int | None = None, optimizer: bool = False, split_backward: bool = False,
                    call_overhead: bool = False, clock: str = "thread") -> Profile:
    """This rank's profile of ``model``'s layer shape (tp = 1), measured on its emulated device.

    Must be called by every rank of the current torch.distributed world at the same point (megatron-core's
    model-parallel groups for the measured layers are created collectively; they are destroyed before it
    returns, with their gloo threads). ``slowdown``: this rank's emulated device against the host
    (``ClusterSpec.slowdown`` of its island; 1.0 on a real device); ``clock``: "thread" (thread CPU time, the
    emulation clock of a bench on shared cores) or "wall". No cache sweep: the other ranks, really running,
    are what the caches see between two of this rank's sections. The other arguments are
    ``profiling.layers.profile_layers``'s."""
    import torch.distributed as dist

    from megatron_het.profiling.layers import profile_layers
    from megatron_het.runtime.group_ledger import GroupLedger

    if not slowdown >= 1.0:
        raise ValueError(f"slowdown must be >= 1 (the emulated device against this host; 1.0: not emulated), "
                         f"got {slowdown}")
    if not dist.is_initialized():
        raise ValueError("profile_in_rank measures inside a run's ranks, but torch.distributed is not initialized; "
                         "call it from every rank after init_process_group (or use profile_layers in one process)")
    ledger = GroupLedger()  # megatron-core's groups for the measured layers: destroyed before the run goes on
    try:
        profile = profile_layers(model, num_layers=num_layers, micro_batch_sizes=micro_batch_sizes, device=device,
                                 warmup=warmup, repeats=repeats, dtype=dtype, implementation="megatron",
                                 vocab_size=vocab_size, optimizer=optimizer, split_backward=split_backward,
                                 call_overhead=call_overhead, clock=clock, idle_factor=slowdown - 1.0, barrier=False)
    finally:
        ledger.seal()
        ledger.destroy()
    how = f"; measured inside a run by each of its {dist.get_world_size()} ranks at once, each on its own emulated device"
    return replace(profile, method=profile.method + how)
