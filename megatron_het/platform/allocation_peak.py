"""Allocated tensor bytes per phase of a run (construction, forward/backward, gradient reduction,
optimizer step, save, load): the level when each phase begins and its peak.

The runtime names its phases with ``phase(name)`` (a ``torch.profiler.record_function`` range,
``megatron_het.<name>``: nearly free when nothing profiles, and labelled in ``--profile`` traces).
``allocation_timeline(device)`` runs code under torch's profiler with ``profile_memory``, which
records every allocation and free of the device's allocator (c10's CPU allocator on the host,
where torch keeps no allocator statistics and the resident set size counts the Python heap and
pages glibc keeps; the caching allocator on a GPU) with its size and time, inside every op,
autograd and collective. The running sum of those records is the allocated bytes (counted from
the profile's start); each phase's peak is its maximum inside the phase's ranges. Slow (every op
is recorded): for measurements and tests, not for training runs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = ["PHASE_PREFIX", "PhaseBytes", "AllocationTimeline", "allocation_timeline", "phase"]

PHASE_PREFIX = "megatron_het."


def phase(name: str):
    """A labelled range of the run (``with phase("reduce"): ...``)."""
    return torch.profiler.record_function(PHASE_PREFIX + name)


@dataclass(frozen=True, kw_only=True)
class PhaseBytes:
    """Allocated bytes over the ranges of one phase, counted from the timeline's start."""

    start_bytes: int  # at the first range's beginning
    peak_bytes: int  # highest inside any of its ranges
    added_bytes: int  # most any one range rose above its own beginning (the phase's own temporaries)
    count: int  # ranges seen (e.g. one per iteration)


@dataclass(kw_only=True)
class AllocationTimeline:
    """Filled when the profiled block ends."""

    phases: dict[str, PhaseBytes] = field(default_factory=dict)  # phase name -> its bytes
    peak_bytes: int = 0  # highest over the whole block
    end_bytes: int = 0  # at its end (what the block left allocated)


def _fill(timeline: AllocationTimeline, prof, device_type) -> None:
    records: list[tuple[int, int]] = []  # (time ns, + allocated / - freed bytes)
    ranges: list[tuple[str, int, int]] = []  # (phase, start ns, end ns)
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name == "[memory]":
            if e.device_type() == device_type:
                records.append((e.start_ns(), int(e.nbytes())))
        elif name.startswith(PHASE_PREFIX):
            ranges.append((name[len(PHASE_PREFIX):], e.start_ns(), e.end_ns()))
    records.sort()
    times = [t for t, _ in records]
    levels, level = [], 0
    for _, nbytes in records:
        level += nbytes
        levels.append(level)
    timeline.peak_bytes = max(levels, default=0)
    timeline.end_bytes = level

    for name, start, end in sorted(ranges, key=lambda r: r[1]):
        first = bisect.bisect_left(times, start)
        last = bisect.bisect_right(times, end)
        before = levels[first - 1] if first else 0
        peak = max(levels[first:last], default=before)
        prev = timeline.phases.get(name)
        if prev is None:
            timeline.phases[name] = PhaseBytes(start_bytes=before, peak_bytes=max(peak, before),
                                               added_bytes=max(peak - before, 0), count=1)
        else:
            timeline.phases[name] = PhaseBytes(start_bytes=prev.start_bytes, peak_bytes=max(prev.peak_bytes, peak),
                                               added_bytes=max(prev.added_bytes, peak - before),
                                               count=prev.count + 1)


@contextmanager
def allocation_timeline(device: torch.device) -> Iterator[AllocationTimeline]:
    """``with allocation_timeline(device) as t: ...`` then ``t.phases["reduce"].peak_bytes`` and so on:
    allocations on ``device`` (its GPU allocator, or the host's) counted from the block's start."""
    from torch.profiler import ProfilerActivity, profile

    timeline = AllocationTimeline()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        device_type = torch.autograd.DeviceType.CUDA
    else:
        device_type = torch.autograd.DeviceType.CPU
    with profile(activities=activities, profile_memory=True) as prof:
        yield timeline
    _fill(timeline, prof, device_type)
