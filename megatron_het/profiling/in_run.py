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

import statistics
from collections.abc import Sequence
from dataclasses import replace

import torch

from megatron_het.cluster import ModelSpec
from megatron_het.perf.profile import PartEntry, Profile, ProfileEntry

__all__ = ["profile_in_rank", "median_profile"]


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


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _same(profiles: Sequence[Profile], what: str, key) -> None:
    keys = list(dict.fromkeys(repr(key(p)) for p in profiles))
    if len(keys) > 1:
        raise ValueError(f"median_profile: the profiles differ in {what}: {keys[0]} vs {keys[1]}"
                         f"{f' (and {len(keys) - 2} more)' if len(keys) > 2 else ''}; combine only profiles of one "
                         "measurement setup (same device, shapes, micro-batches, options)")


def median_profile(profiles: Sequence[Profile], *, what: str = "profiles") -> Profile:
    """One profile whose every measured time is the median over ``profiles`` (measured alike: same device,
    entries, parts and options; peak memory, which does not vary between them, is the first one's).
    ``what`` names them in the method, e.g. "8 ranks of two spawns of bench/schedules.py". Profiles with
    a measured link or a fitted compute model are refused (combine the layer measurements only)."""
    if not profiles:
        raise ValueError("median_profile needs at least one profile, got none")
    _same(profiles, "device", lambda p: p.device)
    _same(profiles, "layer entries", lambda p: [(e.shape(), e.micro_batch_size, e.tp, e.includes_tp_comm)
                                                for e in p.entries])
    _same(profiles, "parts", lambda p: [(q.part, q.hidden_size, q.vocab_size, q.seq_length, q.micro_batch_size, q.tp)
                                        for q in p.parts])
    _same(profiles, "measured options (optimizer, B/W split, call overhead)",
          lambda p: (p.optimizer_s_per_parameter is None, p.backward_split is None, p.call_overhead is None,
                     p.call_overhead_layers))
    if any(p.link is not None or p.compute_model for p in profiles):
        raise ValueError("median_profile combines measured layers, parts and optimizer steps; these profiles "
                         "carry a measured link or a fitted compute model: drop them (dataclasses.replace(profile, "
                         "link=None, compute_model={})) and measure links once")
    first = profiles[0]

    def entry(i: int) -> ProfileEntry:
        return replace(first.entries[i], forward_s=_median([p.entries[i].forward_s for p in profiles]),
                       backward_s=_median([p.entries[i].backward_s for p in profiles]))

    def part(i: int) -> PartEntry:
        return replace(first.parts[i], forward_s=_median([p.parts[i].forward_s for p in profiles]),
                       backward_s=_median([p.parts[i].backward_s for p in profiles]))

    def pair(get) -> tuple[float, float] | None:
        if get(first) is None:
            return None
        return _median([get(p)[0] for p in profiles]), _median([get(p)[1] for p in profiles])

    how = f"; median over {len(profiles)} {what}"
    return replace(first, entries=tuple(entry(i) for i in range(len(first.entries))),
                   parts=tuple(part(i) for i in range(len(first.parts))),
                   optimizer_s_per_parameter=None if first.optimizer_s_per_parameter is None else _median(
                       [p.optimizer_s_per_parameter for p in profiles]),
                   backward_split=pair(lambda p: p.backward_split), call_overhead=pair(lambda p: p.call_overhead),
                   method=first.method + how, source=None,
                   optimizer_method=first.optimizer_method and first.optimizer_method + how,
                   backward_split_method=first.backward_split_method and first.backward_split_method + how,
                   call_overhead_method=first.call_overhead_method and first.call_overhead_method + how)
