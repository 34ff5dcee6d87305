"""Pipeline schedules as data: per-stage action lists, generators, validation, simulation."""

from megatron_het.schedule.engine import ActionTiming, Stuck, dependencies
from megatron_het.schedule.errors import ScheduleError
from megatron_het.schedule.generators import (
    SCHEDULE_NAMES,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    interleaved_table,
    one_f_one_b,
    zero_bubble_h1,
)
from megatron_het.schedule.render import render_grid
from megatron_het.schedule.simulate import SimResult, simulate, validate_schedule
from megatron_het.schedule.types import ACTION_KINDS, Action, Schedule

__all__ = [
    "ACTION_KINDS",
    "SCHEDULE_NAMES",
    "Action",
    "ActionTiming",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "Stuck",
    "build_schedule",
    "dependencies",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_table",
    "one_f_one_b",
    "render_grid",
    "simulate",
    "validate_schedule",
    "zero_bubble_h1",
]
