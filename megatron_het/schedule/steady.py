"""Pipeline timings at any micro-batch count without one action per micro-batch (#21).

A schedule's action lists grow with the micro-batch count, and so does simulating them: a plan
with 10^7 micro-batches per replica would build and run tens of millions of actions. With
per-stage durations that do not depend on the micro-batch (what the predictor prices), every
schedule here settles after its warm-up into a steady state in which each further group of
``num_stages`` micro-batches adds the same time to every stage. ``pipeline_times`` simulates
small counts exactly and, past ``EXACT_UP_TO``, simulates three short counts of the same residue,
checks that the steps are equal, and extends the line: cost independent of the count.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_het.schedule.generators import build_schedule
from megatron_het.schedule.simulate import DurationFn, P2PFn, simulate

__all__ = ["EXACT_UP_TO", "PipelineTimes", "pipeline_times"]

EXACT_UP_TO = 512  # micro-batches per replica simulated action by action
_LINEAR_RTOL = 1e-9  # two steps agreeing to this relative tolerance count as the steady state
_MAX_BASE = 8192  # largest base count tried before giving up on extrapolation


@dataclass(frozen=True, kw_only=True)
class PipelineTimes:
    """One replica's iteration, per stage, as the simulator's SimResult summarises it."""

    iteration_time: float  # end of the last action (all stages start at 0)
    stage_end: tuple[float, ...]  # per stage, end of its last action
    busy: tuple[float, ...]  # per stage, total compute time
    idle: tuple[float, ...]  # per stage, iteration_time - busy (the pipeline bubble)
    extrapolated: bool  # True when extended from shorter simulations instead of run in full

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all stages' time over the iteration."""
        total = self.iteration_time * len(self.busy)
        return sum(self.idle) / total if total > 0 else 0.0


def _exact(name: str, num_stages: int, m: int, num_chunks: int, duration: DurationFn,
           p2p: P2PFn | None) -> tuple[float, ...]:
    sim = simulate(build_schedule(name, num_stages, m, num_chunks), duration, p2p)
    ends = tuple(max((t.end for t in row), default=0.0) for row in sim.timings)
    return (sim.iteration_time, *ends, *sim.busy)


def _times(vector: tuple[float, ...], p: int, *, extrapolated: bool) -> PipelineTimes:
    it, ends, busy = vector[0], vector[1:1 + p], vector[1 + p:]
    return PipelineTimes(iteration_time=it, stage_end=tuple(ends), busy=tuple(busy),
                         idle=tuple(it - b for b in busy), extrapolated=extrapolated)


def pipeline_times(name: str, num_stages: int, num_micro_batches: int, num_chunks: int, duration: DurationFn,
                   p2p: P2PFn | None = None, *, exact_up_to: int = EXACT_UP_TO) -> PipelineTimes:
    """Timings of ``build_schedule(name, ...)`` under ``duration``/``p2p`` (see ``simulate``).

    ``duration`` and ``p2p`` must not depend on the action's micro-batch index (they may depend on
    the stage, the kind and the chunk). Exact up to ``exact_up_to`` micro-batches; beyond, within
    a relative 1e-9 of the full simulation.
    """
    p, m = num_stages, num_micro_batches
    if m <= exact_up_to:
        return _times(_exact(name, p, m, num_chunks, duration, p2p), p, extrapolated=False)
    step = p  # interleaving needs multiples of the pipeline size; a whole round suits every schedule
    base = max(exact_up_to // 2, 4 * p * num_chunks)
    while base <= _MAX_BASE:
        m0 = base + (m - base) % step
        if m0 + 2 * step > m:
            break
        a, b, c = (_exact(name, p, k, num_chunks, duration, p2p) for k in (m0, m0 + step, m0 + 2 * step))
        scale = max(abs(x) for x in c) or 1.0
        if all(abs((y - x) - (z - y)) <= _LINEAR_RTOL * scale for x, y, z in zip(a, b, c)):
            steps = (m - m0) // step
            return _times(tuple(x + steps * (y - x) for x, y in zip(a, b)), p, extrapolated=True)
        base *= 2  # still in the warm-up transient: start later
    return _times(_exact(name, p, m, num_chunks, duration, p2p), p, extrapolated=False)
