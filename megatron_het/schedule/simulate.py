"""Timed simulation of a schedule (what the performance model uses) and validation."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_het.schedule.engine import (
    ActionTiming,
    DurationFn,
    P2PFn,
    Trace,
    check_complete,
    run,
    unit_duration,
)
from megatron_het.schedule.errors import ScheduleError
from megatron_het.schedule.render import render_trace
from megatron_het.schedule.types import Schedule


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Timings of one iteration of one replica."""

    schedule: Schedule  # what was simulated
    timings: tuple[tuple[ActionTiming, ...], ...]  # per stage, in list order
    iteration_time: float  # end of the last action (all stages start at 0)
    busy: tuple[float, ...]  # per stage, total compute time
    idle: tuple[float, ...]  # per stage, iteration_time - busy (the pipeline bubble)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all stages' time over the iteration."""
        total = self.iteration_time * len(self.busy)
        return sum(self.idle) / total if total > 0 else 0.0

    def stage_bubble_fraction(self, stage: int) -> float:
        """Idle share of one stage over the iteration."""
        return self.idle[stage] / self.iteration_time if self.iteration_time > 0 else 0.0


def _deadlock_error(schedule: Schedule, trace: Trace, width: int = 120) -> ScheduleError:
    first = trace.stuck[0]
    return ScheduleError(
        field=f"actions[{first.stage}]",
        value=[str(x.action) for x in trace.stuck],
        problem=f"schedule {schedule.name!r} deadlocks: no stage can start its next action; {first}",
        fix="reorder the action lists so every action's dependency can run first "
        "(see the grid and the stuck list below)",
        grid=render_trace(trace.timings, trace.stuck, width),
    )


def simulate(schedule: Schedule, duration: DurationFn, p2p: P2PFn | None = None) -> SimResult:
    """Simulate one iteration.

    ``duration(stage, action)`` is the compute time of an action; ``p2p(src_stage, dst_stage,
    action)`` is the transfer time added when ``action`` (done on src_stage) feeds dst_stage.
    Raises ScheduleError for incomplete or deadlocking schedules.
    """
    check_complete(schedule)
    trace = run(schedule, duration, p2p)
    if trace.stuck:
        raise _deadlock_error(schedule, trace)
    end = max((t.end for row in trace.timings for t in row), default=0.0)
    busy = tuple(sum(t.end - t.start for t in row) for row in trace.timings)
    return SimResult(schedule=schedule, timings=trace.timings, iteration_time=end, busy=busy,
                     idle=tuple(end - b for b in busy))


def validate_schedule(schedule: Schedule) -> None:
    """Raise ScheduleError for missing/duplicate actions or a deadlock (unit durations)."""
    check_complete(schedule)
    trace = run(schedule, unit_duration)
    if trace.stuck:
        raise _deadlock_error(schedule, trace)
