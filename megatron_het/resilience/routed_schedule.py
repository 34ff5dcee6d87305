"""Schedules for a Routing: per-instance action lists over *global* micro-batches, as data.

Instances run micro-batches of several pipelines (their own replica's and the ones they took
over), so a per-replica generator does not apply. The lists are produced by a greedy list
scheduler that simulates the iteration: whenever an instance is free it starts its earliest-ready
action, preferring B over F over W; a forward is held back while its pipeline already has
``num_stages - stage`` micro-batches in flight on the instance (1F1B's memory bound). With
``split_backward`` each backward is an input-gradient ``B`` (on the critical path, sent upstream
at once) and a weight-gradient ``W`` that only waits for the instance to be idle: re-routed
micro-batches fill the pipeline bubbles (zero-bubble style). The recorded start order is a
topological order of every dependency, so the runtime executing these lists with blocking receives
and asynchronous sends cannot deadlock; the same simulation is the performance prediction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from megatron_het.resilience.routing import InstanceKey, Routing
from megatron_het.schedule import Action, ScheduleError

# (instance, kind "F"/"B"/"W", is_split) -> seconds; p2p: (src instance, dst instance) -> seconds
RoutedDurationFn = Callable[[InstanceKey, str, bool], float]
RoutedP2PFn = Callable[[InstanceKey, InstanceKey], float]
_PRIORITY = {"B": 0, "F": 1, "W": 2}


@dataclass(frozen=True, kw_only=True)
class RoutedSchedule:
    """Action lists per instance and their simulated timing. ``micro_batch`` is a global index here, as
    ``runtime/executor.py`` runs every action list (a plan Schedule's per-replica indices are offset
    to global ones by the pipeline strategy)."""

    actions: dict[InstanceKey, tuple[Action, ...]]  # per instance, execution order
    split_backward: bool  # True: B is input-gradient only, W follows separately
    iteration_time: float  # simulated end of the last action (same unit as the durations)
    busy: dict[InstanceKey, float]  # per instance, summed compute time
    finish: dict[InstanceKey, float] = field(default_factory=dict)  # per instance, end of its last action
    # (instance, kind, global micro-batch) -> simulated (start, end) of that action
    times: dict[tuple[InstanceKey, str, int], tuple[float, float]] = field(default_factory=dict)

    def bubble_fraction(self) -> float:
        """Idle share of all instances' time."""
        total = self.iteration_time * len(self.busy)
        return 1.0 - sum(self.busy.values()) / total if total > 0 else 0.0


def unit_durations(instance: InstanceKey, kind: str, split: bool) -> float:
    """F = 1, fused backward = 2, split B = W = 1 (backward costs two forwards)."""
    return 1.0 if (kind == "F" or split) else 2.0


def routed_schedule(routing: Routing, *, split_backward: bool = True, duration: RoutedDurationFn = unit_durations,
                    p2p: RoutedP2PFn | None = None, start: Mapping[InstanceKey, float] | None = None
                    ) -> RoutedSchedule:
    """Simulate one iteration of ``routing`` and return every instance's action list.

    ``start``: per instance, when it may begin (default 0: all at once); ``staggered.py`` chains
    iterations with it."""
    keys = [i.key for i in routing.instances]
    # per (instance, global micro-batch): (pipeline index, stage index)
    where: dict[tuple[InstanceKey, int], tuple[int, int]] = {}
    forwards: dict[InstanceKey, list[tuple[int, int]]] = {k: [] for k in keys}  # (g, pipeline) in order
    share: dict[tuple[InstanceKey, int], float] = {}  # part of the instance's layers it runs for g (covers)
    for v, pipe in enumerate(routing.pipelines):
        for g in pipe.micro_batches:
            for s, hop in enumerate(pipe.hops):
                where[(hop, g)] = (v, s)
                share[(hop, g)] = routing.fraction(pipe, s)
                forwards[hop].append((g, v))
    # an instance serving several pipelines takes their forwards round-robin (i-th micro-batch of each
    # pipeline before the (i+1)-th of any), not by global index: a taken-over pipeline is not starved
    # until the instance's own micro-batches are done
    nth = {g: i for pipe in routing.pipelines for i, g in enumerate(pipe.micro_batches)}
    for k in keys:
        forwards[k].sort(key=lambda gv: (nth[gv[0]], gv[1]))
    done: dict[tuple[InstanceKey, str, int], float] = {}
    free = {k: float((start or {}).get(k, 0.0)) for k in keys}
    busy = dict.fromkeys(keys, 0.0)
    next_f = dict.fromkeys(keys, 0)
    in_flight: dict[tuple[InstanceKey, int], int] = {}
    waiting_b: dict[InstanceKey, list[int]] = {k: [] for k in keys}  # F done, B not yet
    waiting_w: dict[InstanceKey, list[int]] = {k: [] for k in keys}  # B done, W not yet
    order: dict[InstanceKey, list[Action]] = {k: [] for k in keys}
    times: dict[tuple[InstanceKey, str, int], tuple[float, float]] = {}
    total = sum(len(f) * (3 if split_backward else 2) for f in forwards.values())

    def dep_time(key: InstanceKey, kind: str, g: int) -> float | None:
        v, s = where[(key, g)]
        hops = routing.pipelines[v].hops
        if kind == "F":
            if s == 0:
                return 0.0
            src = hops[s - 1]
            t = done.get((src, "F", g))
            return None if t is None else t + (p2p(src, key) if p2p else 0.0)
        if kind == "B":
            own = done.get((key, "F", g))
            if own is None or s == len(hops) - 1:
                return own
            src = hops[s + 1]
            t = done.get((src, "B", g))
            return None if t is None else max(own, t + (p2p(src, key) if p2p else 0.0))
        return done.get((key, "B", g))

    while len(done) < total:
        best = None
        for k in keys:
            cands = [("B", g) for g in waiting_b[k]] + [("W", g) for g in waiting_w[k]]
            if next_f[k] < len(forwards[k]):
                g, v = forwards[k][next_f[k]]
                s = where[(k, g)][1]
                if in_flight.get((k, v), 0) < len(routing.pipelines[v].hops) - s:
                    cands.append(("F", g))
            for kind, g in cands:
                t = dep_time(k, kind, g)
                if t is None:
                    continue
                cand = (max(t, free[k]), _PRIORITY[kind], nth[g], g, keys.index(k), k, kind)
                if best is None or cand < best:
                    best = cand
        if best is None:
            stuck = {k: [str(a) for a in order[k][-3:]] for k in keys}
            raise ScheduleError(field="routing", value=stuck, problem="the routed schedule cannot make progress",
                                fix="report this routing; every pipeline must be a chain of distinct instances")
        start, _, _, g, _, k, kind = best
        dt = float(duration(k, kind, split_backward)) * share[(k, g)]
        done[(k, kind, g)] = start + dt
        times[(k, kind, g)] = (start, start + dt)
        free[k] = start + dt
        busy[k] += dt
        order[k].append(Action(kind=kind, micro_batch=g))
        v = where[(k, g)][0]
        if kind == "F":
            next_f[k] += 1
            in_flight[(k, v)] = in_flight.get((k, v), 0) + 1
            waiting_b[k].append(g)
        elif kind == "B":
            in_flight[(k, v)] -= 1
            waiting_b[k].remove(g)
            if split_backward:
                waiting_w[k].append(g)
        else:
            waiting_w[k].remove(g)
    end = max(free.values(), default=0.0)
    return RoutedSchedule(actions={k: tuple(a) for k, a in order.items()}, split_backward=split_backward,
                          iteration_time=end, busy=busy, finish=dict(free), times=times)
