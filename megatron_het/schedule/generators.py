"""Schedule generators. Orders follow megatron-core 0.19 (1F1B, interleaved) and the ZB-H1 paper."""

from __future__ import annotations

from megatron_het.schedule.errors import ScheduleError
from megatron_het.schedule.types import Action, Schedule

SCHEDULE_NAMES = ("1f1b", "gpipe", "interleaved", "zb-h1")  # names accepted by build_schedule
SPLIT_BACKWARD_SCHEDULES = ("zb-h1",)  # schedules whose backward is two actions (B: input grads, W: weight grads)


def _check_counts(num_stages: int, num_micro_batches: int, num_chunks: int = 1) -> None:
    for name, value in (("num_stages", num_stages), ("num_micro_batches", num_micro_batches),
                        ("num_chunks", num_chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(field=name, value=value, problem=f"{name} must be an integer >= 1",
                                fix=f"set {name} to 1 or more")


def _f(m: int, c: int = 0) -> Action:
    return Action(kind="F", micro_batch=m, chunk=c)


def _b(m: int, c: int = 0) -> Action:
    return Action(kind="B", micro_batch=m, chunk=c)


def _w(m: int, c: int = 0) -> Action:
    return Action(kind="W", micro_batch=m, chunk=c)


def one_f_one_b(num_stages: int, num_micro_batches: int) -> Schedule:
    """Megatron's non-interleaved 1F1B: warm-up forwards, steady F/B pairs, cool-down backwards."""
    _check_counts(num_stages, num_micro_batches)
    m = num_micro_batches
    per_stage = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, m)
        acts = [_f(i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [_f(warmup + i), _b(i)]
        acts += [_b(i) for i in range(m - warmup, m)]
        per_stage.append(tuple(acts))
    return Schedule(name="1f1b", num_stages=num_stages, num_micro_batches=m, actions=tuple(per_stage),
                    split_backward=False)


def gpipe(num_stages: int, num_micro_batches: int) -> Schedule:
    """GPipe: every forward, then every backward (peak memory = all micro-batches)."""
    _check_counts(num_stages, num_micro_batches)
    m = num_micro_batches
    acts = tuple([_f(i) for i in range(m)] + [_b(i) for i in range(m)])
    return Schedule(name="gpipe", num_stages=num_stages, num_micro_batches=m,
                    actions=tuple(acts for _ in range(num_stages)), split_backward=False)


def interleaved_table(
    num_micro_batches: int, num_chunks: int, group_size: int
) -> tuple[tuple[int, int], ...]:
    """(micro_batch, chunk) per virtual micro-batch id, as megatron-core's get_schedule_table."""
    table: list[tuple[int, int]] = []
    for first in range(0, num_micro_batches, group_size):
        stop = num_micro_batches if first + group_size >= num_micro_batches else first + group_size
        table += [(mb, c) for c in range(num_chunks) for mb in range(first, stop)]
    return tuple(table)


def interleaved_1f1b(
    num_stages: int, num_micro_batches: int, num_chunks: int, *, microbatch_group_size: int | None = None
) -> Schedule:
    """Megatron's interleaved 1F1B (forward_backward_pipelining_with_interleaving, no overlap flags).

    Stage s runs min(2*(p-s-1) + (chunks-1)*group, m*chunks) warm-up forwards, then F/B pairs, then
    backwards. Forward k runs table[k]; backward k runs table[k]'s micro-batch on chunk
    chunks-1-table[k].chunk. group (microbatch_group_size) defaults to num_stages as in Megatron.
    """
    _check_counts(num_stages, num_micro_batches, num_chunks)
    p, m = num_stages, num_micro_batches
    group = p if microbatch_group_size is None else microbatch_group_size
    if not p <= group <= m:
        raise ScheduleError(
            field="num_micro_batches", value=m,
            problem=f"interleaving needs num_stages <= micro-batch group size <= num_micro_batches "
            f"({p} <= {group} <= {m})",
            fix=f"use at least {max(p, group)} micro-batches per replica, a multiple of {p}",
        )
    if 0 < m % group < p:
        raise ScheduleError(
            field="num_micro_batches", value=m,
            problem=f"the last micro-batch group has {m % group} micro-batches, fewer than num_stages "
            f"{p} (megatron-core rejects this)",
            fix=f"use a number of micro-batches that is a multiple of {group}",
        )
    table = interleaved_table(m, num_chunks, group)
    total = m * num_chunks

    def fwd(k: int) -> Action:
        return _f(table[k][0], table[k][1])

    def bwd(k: int) -> Action:
        return _b(table[k][0], num_chunks - 1 - table[k][1])

    per_stage, steps = [], []
    for s in range(p):
        warmup = min((p - s - 1) * 2 + (num_chunks - 1) * group, total)
        acts = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [fwd(warmup + k), bwd(k)]
        acts += [bwd(k) for k in range(total - warmup, total)]
        per_stage.append(tuple(acts))
        # megatron-core communicates once per steady F/B pair (send_forward_backward_recv_forward_backward)
        steps.append((1,) * warmup + (2,) * (total - warmup) + (1,) * warmup)
    return Schedule(name="interleaved", num_stages=p, num_micro_batches=m, num_chunks=num_chunks,
                    actions=tuple(per_stage), split_backward=False,
                    steps=tuple(steps) if any(n > 1 for st in steps for n in st) else None)


def zero_bubble_h1(num_stages: int, num_micro_batches: int) -> Schedule:
    """ZB-H1 (Qi et al., 2023): B and W split; stage s defers up to s weight-gradient passes.

    Per stage: p-s-1 warm-up forwards (as 1F1B), s F/B pairs, F/B/W triples, then B/W pairs and
    the deferred Ws, which fill the cool-down bubble. F-minus-B in flight never exceeds 1F1B's.
    """
    _check_counts(num_stages, num_micro_batches)
    p, m = num_stages, num_micro_batches
    per_stage = []
    for s in range(p):
        f = b = w = 0
        acts: list[Action] = []
        for _ in range(min(p - s - 1, m)):
            acts.append(_f(f))
            f += 1
        for _ in range(s):
            if f == m:
                break
            acts += [_f(f), _b(b)]
            f, b = f + 1, b + 1
        while f < m:
            acts += [_f(f), _b(b), _w(w)]
            f, b, w = f + 1, b + 1, w + 1
        while b < m:
            acts += [_b(b), _w(w)]
            b, w = b + 1, w + 1
        acts += [_w(i) for i in range(w, m)]
        per_stage.append(tuple(acts))
    return Schedule(name="zb-h1", num_stages=p, num_micro_batches=m, actions=tuple(per_stage),
                    split_backward=True)


def build_schedule(name: str, num_stages: int, num_micro_batches: int, num_chunks: int = 1) -> Schedule:
    """Dispatch on a schedule name from SCHEDULE_NAMES."""
    if name == "interleaved":
        return interleaved_1f1b(num_stages, num_micro_batches, num_chunks)
    builders = {"1f1b": one_f_one_b, "gpipe": gpipe, "zb-h1": zero_bubble_h1}
    if name not in builders:
        raise ScheduleError(field="schedule", value=name, problem="unknown schedule name",
                            fix="use one of " + ", ".join(SCHEDULE_NAMES))
    if num_chunks != 1:
        raise ScheduleError(
            field="num_chunks", value=num_chunks,
            problem=f"schedule {name!r} runs one model chunk per stage, not {num_chunks}",
            fix='use schedule "interleaved" for several chunks, or num_chunks=1',
        )
    return builders[name](num_stages, num_micro_batches)
