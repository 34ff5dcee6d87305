"""pipeline_times: exact below EXACT_UP_TO, the full simulation's answer (1e-9 relative) above it, in
time independent of the micro-batch count (#21 item 5)."""

from __future__ import annotations

import time

import pytest

from megatron_het.schedule import build_schedule, simulate
from megatron_het.schedule.steady import pipeline_times

# Uneven stages (the slowest is in the middle) and uneven links, as a heterogeneous replica has.
FWD = (1.0, 1.7, 1.2, 0.9)
HOPS = {(0, 1): 0.05, (1, 2): 0.3, (2, 3): 0.01}


def _durations(split: bool):
    def duration(stage, action):  # backward = 2 x forward, halved into B and W when split
        return FWD[stage] * (1.0 if action.kind == "F" else 2.0) / (2 if split else 1)

    return duration


_duration = _durations(False)


def _p2p(src, dst, action):
    return HOPS.get((min(src, dst), max(src, dst)), 0.0)


@pytest.mark.parametrize("name,chunks", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_extrapolation_matches_full_simulation(name, chunks):
    duration = _durations(name == "zb-h1")
    m = 1000  # above the exact limit used below, a multiple of 4 for interleaving
    full = simulate(build_schedule(name, 4, m, chunks), duration, _p2p)
    got = pipeline_times(name, 4, m, chunks, duration, _p2p, exact_up_to=64)
    assert got.extrapolated
    assert got.iteration_time == pytest.approx(full.iteration_time, rel=1e-9)
    assert got.busy == pytest.approx(full.busy, rel=1e-9)
    ends = [max(t.end for t in row) for row in full.timings]
    assert got.stage_end == pytest.approx(ends, rel=1e-9)
    assert got.bubble_fraction == pytest.approx(full.bubble_fraction, rel=1e-6)


def test_small_counts_are_simulated_exactly():
    full = simulate(build_schedule("1f1b", 4, 12), _duration, _p2p)
    got = pipeline_times("1f1b", 4, 12, 1, _duration, _p2p)
    assert not got.extrapolated and got.iteration_time == full.iteration_time and got.busy == full.busy


def test_huge_count_costs_no_more_than_a_small_one():
    start = time.monotonic()
    got = pipeline_times("1f1b", 4, 10**9, 1, _duration, _p2p)
    assert time.monotonic() - start < 5.0
    # steady state: the slowest stage (1.7 s forward + 3.4 s backward) per micro-batch
    assert got.iteration_time / 10**9 == pytest.approx(3 * max(FWD), rel=1e-6)
