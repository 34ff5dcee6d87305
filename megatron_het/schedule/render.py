"""Text grid of a schedule: one row per stage, one column per time step."""

from __future__ import annotations

import math
from typing import Protocol

from megatron_het.schedule.engine import ActionTiming, Stuck, Trace, run, unit_duration
from megatron_het.schedule.types import Schedule


class Timed(Protocol):
    """What ``render_grid`` needs of a simulation (simulate.SimResult): per-stage action timings."""

    timings: tuple[tuple[ActionTiming, ...], ...]


def render_trace(
    timings: tuple[tuple[ActionTiming, ...], ...], stuck: tuple[Stuck, ...] = (), width: int = 120
) -> str:
    """Grid of what ran; the time step is the shortest action, coarsened to fit ``width`` steps.

    An action's label sits in its first cell; later cells of the same action show ``-``.
    Blocked stages are listed under the grid.
    """
    spans = [t for row in timings for t in row]
    end = max((t.end for t in spans), default=0.0)
    positive = [t.end - t.start for t in spans if t.end > t.start]
    step = min(positive, default=1.0)
    if end / step > width:
        step = end / width
    cells = max(1, math.ceil(end / step - 1e-9)) if spans else 0
    cw = max([len(str(t.action)) for t in spans] + [2]) + 1
    label_w = len(str(len(timings) - 1))
    lines = []
    for s, row in enumerate(timings):
        grid = [" " * cw] * cells
        for t in row:
            c0 = min(round(t.start / step), max(cells - 1, 0))
            c1 = max(c0 + 1, round(t.end / step))
            if cells:
                grid[c0] = str(t.action).ljust(cw)
            for c in range(c0 + 1, min(c1, cells)):
                grid[c] = "-" * (cw - 1) + " "
        lines.append(f"stage {s:>{label_w}} | " + "".join(grid).rstrip())
    if stuck:
        lines.append("stuck:")
        lines += [f"  {x}" for x in stuck]
    return "\n".join(lines)


def render_grid(schedule: Schedule, sim: Timed | None = None, width: int = 120) -> str:
    """Grid of ``sim``'s timings, or of a unit-duration run (showing where stages get stuck)."""
    if sim is not None:
        return render_trace(sim.timings, (), width)
    trace: Trace = run(schedule, unit_duration)
    return render_trace(trace.timings, trace.stuck, width)
