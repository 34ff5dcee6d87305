"""Several measurements of one device combined into one profile (the median of every measured figure).

Used by profiling.in_run (a run's ranks, several spawns) and profiling.layers.profile_emulated (the ranks of
one emulated island); kept apart so that both import it without importing each other.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from megatron_het.perf.profile import PartEntry, Profile, ProfileEntry

__all__ = ["median_profile"]


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
