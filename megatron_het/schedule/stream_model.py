"""NCCL's weakest promise, modelled: can every device's batches of point-to-point transfers complete?

What NCCL and RCCL guarantee at least: a device runs its communication kernels one at a time, in
the order they were issued (kernels of different communicators may not be resident together: NCCL's
docs say relying on that "could break at any time"); a batch (``batch_isend_irecv``, one grouped
kernel) progresses all its transfers at once; a transfer completes only while its partner's kernel
is resident (no eager buffering of sends: true beyond the library's small buffer, so of any real
activation); transfers between two devices match in issue order, per direction (no tags).

``run_streams`` plays that over every device's kernels and reports the kernels that can never
complete (a deadlock) and the transfers matched to the wrong message (what tags would have caught).
``schedule_streams`` builds the kernels from a schedule exactly as the executor posts them
(``transfers.transfer_steps``), so the runtime's start-up check and the tests share one model.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from megatron_het.schedule.errors import ScheduleError
from megatron_het.schedule.transfers import Post, schedule_messages, stage_transfer_steps
from megatron_het.schedule.types import Schedule

__all__ = ["StreamOp", "StreamOutcome", "check_transfer_streams", "post_kernels", "run_streams", "schedule_streams"]


@dataclass(frozen=True, kw_only=True)
class StreamOp:
    """One transfer of a kernel."""

    send: bool  # a send (else a receive)
    peer: Hashable  # the device on the other end
    message: Hashable  # what the schedule means it to carry (compared between the two ends)


@dataclass(frozen=True, kw_only=True)
class StreamOutcome:
    """What ``run_streams`` found."""

    stuck: dict = field(default_factory=dict)  # device -> index of its kernel that never completes
    mismatches: tuple[str, ...] = ()  # transfers whose two ends mean different messages, or have no partner

    @property
    def ok(self) -> bool:
        return not self.stuck and not self.mismatches


def _partners(kernels: Mapping[Hashable, Sequence[Sequence[StreamOp]]]):
    """(device, kernel, op) -> its partner's (device, kernel, op), matching by issue order per direction."""
    queues: dict[tuple, list[tuple]] = {}  # (src, dst, "send"/"recv") -> ops in issue order
    for d, ks in kernels.items():
        for k, ops in enumerate(ks):
            for o, op in enumerate(ops):
                key = (d, op.peer, "send") if op.send else (op.peer, d, "recv")
                queues.setdefault(key, []).append((d, k, o))
    partner, problems = {}, []
    for (src, dst, kind), mine in queues.items():
        if kind != "send":
            continue
        theirs = queues.get((src, dst, "recv"), [])
        for n, (a, b) in enumerate(zip(mine, theirs)):
            sent, got = kernels[a[0]][a[1]][a[2]].message, kernels[b[0]][b[1]][b[2]].message
            if sent != got:
                problems.append(f"transfer {n} from {src} to {dst}: sent {sent}, received as {got}")
            partner[a], partner[b] = b, a
        if len(mine) != len(theirs):
            problems.append(f"{src} sends {len(mine)} transfers to {dst}, which receives {len(theirs)}")
    for (src, dst, kind), theirs in queues.items():
        if kind == "recv" and (src, dst, "send") not in queues:
            problems.append(f"{dst} receives {len(theirs)} transfers from {src}, which sends none")
    return partner, problems


def run_streams(kernels: Mapping[Hashable, Sequence[Sequence[StreamOp]]]) -> StreamOutcome:
    """Play every device's kernels under the weakest promise (module docstring)."""
    partner, problems = _partners(kernels)
    head = dict.fromkeys(kernels, 0)  # device -> its resident kernel
    done: set[tuple] = set()
    progress = True
    while progress:
        progress = False
        for d, ks in kernels.items():
            k = head[d]
            if k >= len(ks):
                continue
            for o in range(len(ks[k])):
                me = (d, k, o)
                other = partner.get(me)
                if me in done or other is None or head[other[0]] != other[1]:
                    continue
                done.update((me, other))
                progress = True
            while head[d] < len(ks) and all((d, head[d], o) in done for o in range(len(ks[head[d]]))):
                head[d] += 1
                progress = True
    stuck = {d: head[d] for d, ks in kernels.items() if head[d] < len(ks)}
    return StreamOutcome(stuck=stuck, mismatches=tuple(problems))


def schedule_streams(schedule: Schedule) -> dict[int, list[list[StreamOp]]]:
    """Stage -> its kernels, one per ``Post`` the executor makes for ``schedule`` (stage level: every
    rank of a stage posts the same batches, to its own partners in the neighbour stage)."""
    return {s: post_kernels(schedule, s, stage_transfer_steps(schedule, s)) for s in range(schedule.num_stages)}


def post_kernels(schedule: Schedule, stage: int, steps) -> list[list[StreamOp]]:
    """The kernels of one stage's ``steps``: sends first, then receives, as the executor lists them."""
    acts = schedule.actions[stage]
    return [[StreamOp(send=True, peer=step.peer, message=schedule_messages(schedule, stage, acts[i], sent=True))
             for i in step.sends] +
            [StreamOp(send=False, peer=step.peer, message=schedule_messages(schedule, stage, acts[i], sent=False))
             for i in step.recvs]
            for step in steps if isinstance(step, Post)]


def check_transfer_streams(schedule: Schedule, *, tags: bool, backend: str) -> None:
    """Raise ``ScheduleError`` when ``schedule``'s batches (as the executor posts them) could wait
    forever under the weakest promise, or, on a backend matching messages by order (``tags`` False:
    NCCL, RCCL), when a transfer would meet the wrong message."""
    outcome = run_streams(schedule_streams(schedule))
    problems = [f"stage {s} would wait forever at its batch {k} of transfers" for s, k in sorted(outcome.stuck.items())]
    if not tags:
        problems += [f"{m} ({backend} matches pipeline messages by order, not tags)" for m in outcome.mismatches]
    if problems:
        raise ScheduleError(field="schedule", value=schedule.name, problem=f"{len(problems)} problem(s) with its "
                            f"pipeline transfers, first: {problems[0]}",
                            fix="use a generated schedule (1f1b, interleaved, zb-h1, gpipe) or reorder the custom one")
