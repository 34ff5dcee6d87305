"""Dependency semantics of a schedule and the event loop shared by simulate, validate and render.

Virtual stage v = chunk * num_stages + stage. F(m) on v needs F(m) on v-1; B(m) on v needs B(m)
on v+1 (the last virtual stage: its own F(m)); W(m) needs B(m) on the same stage and chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_het.schedule.errors import ScheduleError
from megatron_het.schedule.types import Action, Schedule

DurationFn = Callable[[int, Action], float]  # (stage, action) -> compute time
P2PFn = Callable[[int, int, Action], float]  # (src_stage, dst_stage, action sent) -> transfer time


@dataclass(frozen=True, kw_only=True)
class ActionTiming:
    """When one action ran on its stage."""

    action: Action  # the action
    start: float  # start time, same unit as the duration function
    end: float  # end time


@dataclass(frozen=True, kw_only=True)
class Stuck:
    """A stage that cannot start its next action, and the missing action it waits for."""

    stage: int  # blocked stage
    action: Action  # its next action
    needs_stage: int  # stage that must run the missing action
    needs: Action  # the missing action

    def __str__(self) -> str:
        return f"stage {self.stage} waits for {self.action} (needs {self.needs} on stage {self.needs_stage})"


@dataclass(frozen=True, kw_only=True)
class Trace:
    """Result of running a schedule as far as its dependencies allow."""

    timings: tuple[tuple[ActionTiming, ...], ...]  # per stage, in list order, only what ran
    stuck: tuple[Stuck, ...]  # empty when every action ran; else one entry per blocked stage


def dependencies(schedule: Schedule, stage: int, action: Action) -> tuple[tuple[int, Action], ...]:
    """(stage, action) pairs that must finish before ``action`` can start on ``stage``."""
    p, v_last = schedule.num_stages, schedule.num_stages * schedule.num_chunks - 1
    m, c = action.micro_batch, action.chunk
    v = c * p + stage
    if action.kind == "F":
        if v == 0:
            return ()
        return (((v - 1) % p, Action(kind="F", micro_batch=m, chunk=(v - 1) // p)),)
    if action.kind == "B":
        own_f = (stage, Action(kind="F", micro_batch=m, chunk=c))
        if v == v_last:
            return (own_f,)
        return (own_f, ((v + 1) % p, Action(kind="B", micro_batch=m, chunk=(v + 1) // p)))
    return ((stage, Action(kind="B", micro_batch=m, chunk=c)),)


def run(schedule: Schedule, duration: DurationFn, p2p: P2PFn | None = None) -> Trace:
    """Run every stage's list in order, each action starting once its stage is free and its
    dependencies (plus p2p time when they come from another stage) are done."""
    p = schedule.num_stages
    done: dict[tuple[int, Action], float] = {}
    free = [0.0] * p
    pos = [0] * p
    timings: list[list[ActionTiming]] = [[] for _ in range(p)]
    waiting: list[tuple[tuple[int, Action], ...] | None] = [None] * p  # a blocked next action's dependencies
    progress = True
    while progress:
        progress = False
        for s in range(p):
            acts = schedule.actions[s]
            while pos[s] < len(acts):
                a = acts[pos[s]]
                deps = waiting[s]
                if deps is None:  # not derived again on every pass while the action waits
                    deps = dependencies(schedule, s, a)
                if not all(map(done.__contains__, deps)):
                    waiting[s] = deps
                    break
                waiting[s] = None
                ready = free[s]
                for ds, da in deps:
                    t = done[(ds, da)]
                    if ds != s and p2p is not None:
                        t += float(p2p(ds, s, da))
                    ready = max(ready, t)
                dt = float(duration(s, a))
                if not dt >= 0:
                    raise ScheduleError(field=f"duration(stage={s}, action={a})", value=dt,
                                        problem="compute time must be a number >= 0",
                                        fix="return a non-negative duration")
                timings[s].append(ActionTiming(action=a, start=ready, end=ready + dt))
                done[(s, a)] = ready + dt
                free[s] = ready + dt
                pos[s] += 1
                progress = True
    stuck = []
    for s in range(p):
        if pos[s] < len(schedule.actions[s]):
            a = schedule.actions[s][pos[s]]
            ds, da = next(d for d in dependencies(schedule, s, a) if d not in done)
            stuck.append(Stuck(stage=s, action=a, needs_stage=ds, needs=da))
    return Trace(timings=tuple(tuple(t) for t in timings), stuck=tuple(stuck))


def unit_duration(stage: int, action: Action) -> float:
    """Every action takes one time unit (used by validation and the default grid)."""
    return 1.0


def check_complete(schedule: Schedule) -> None:
    """Every stage runs exactly one F, one B and (when split) one W per (micro-batch, chunk)."""
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    expected = {
        Action(kind=k, micro_batch=m, chunk=c)
        for k in kinds for m in range(schedule.num_micro_batches) for c in range(schedule.num_chunks)
    }
    for s, acts in enumerate(schedule.actions):
        seen: dict[Action, int] = {}
        for i, a in enumerate(acts):
            if a not in expected:
                why = ("W actions need split_backward=True" if a.kind == "W" and not schedule.split_backward
                       else f"micro_batch must be < {schedule.num_micro_batches} and chunk < "
                       f"{schedule.num_chunks}")
                raise ScheduleError(field=f"actions[{s}][{i}]", value=str(a),
                                    problem=f"action does not belong to this schedule ({why})",
                                    fix="remove it or fix its micro-batch/chunk index")
            if a in seen:
                raise ScheduleError(field=f"actions[{s}][{i}]", value=str(a),
                                    problem=f"duplicate: stage {s} already runs {a} at position {seen[a]}",
                                    fix="list each action once per stage")
            seen[a] = i
        missing = sorted(expected - seen.keys(), key=lambda a: (a.micro_batch, a.chunk, a.kind))
        if missing:
            raise ScheduleError(
                field=f"actions[{s}]", value=[str(a) for a in missing[:8]],
                problem=f"stage {s} is missing {len(missing)} of {len(expected)} actions",
                fix="add the missing actions to the stage's list",
            )
