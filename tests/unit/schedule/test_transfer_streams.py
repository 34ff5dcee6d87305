"""Pipeline transfers under NCCL's weakest promise (schedule/transfers.py, schedule/stream_model.py).

The model: a device runs one communication kernel at a time, in issue order; a batch is one kernel;
a transfer completes only while its partner's kernel is resident; transfers match by order per
direction. Every generated schedule's batches, as the executor posts them, complete under it, in
training and in a forward-only evaluation. The counter-examples show the model can fail and why the
batching is what it is: the old executor's unbatched transfers on one group per boundary, every
stage posting downstream first, interleaving without megatron-core's F/B pair steps.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_het.schedule import Schedule, ScheduleError, build_schedule
from megatron_het.schedule.stream_model import (
    StreamOp,
    check_transfer_streams,
    post_kernels,
    run_streams,
    schedule_streams,
)
from megatron_het.schedule.transfers import Post, forward_only, stage_peers, stage_transfer_steps, transfer_steps


def _cases():
    for name in ("1f1b", "gpipe", "zb-h1", "interleaved"):
        for p in range(2, 9):
            for m in range(1, 17):
                for v in (2, 3, 4) if name == "interleaved" else (1,):
                    try:
                        yield build_schedule(name, p, m, v)
                    except ScheduleError:  # interleaving's micro-batch constraints
                        continue


def _forward_only_streams(schedule):
    return {s: post_kernels(schedule, s, forward_only(stage_transfer_steps(schedule, s), schedule.actions[s]))
            for s in range(schedule.num_stages)}


def test_every_generated_schedule_completes_in_training_and_evaluation():
    schedules = list(_cases())
    assert len(schedules) == 414
    for schedule in schedules:
        key = (schedule.name, schedule.num_stages, schedule.num_micro_batches, schedule.num_chunks)
        assert run_streams(schedule_streams(schedule)).ok, key
        assert run_streams(_forward_only_streams(schedule)).ok, key


def _unbatched(schedule):
    """The executor before batching: each transfer alone, a receive just before its action, a send just
    after it, on one group per boundary."""
    out = {}
    for s, acts in enumerate(schedule.actions):
        recv_from, send_to = stage_peers(schedule, s)
        steps = []
        for i in range(len(acts)):
            steps += [Post(peer=recv_from(i), recvs=(i,))] if recv_from(i) is not None else []
            steps += [Post(peer=send_to(i), sends=(i,))] if send_to(i) is not None else []
        out[s] = post_kernels(schedule, s, steps)
    return out


def test_unbatched_transfers_on_one_group_per_boundary_deadlock_1f1b():
    outcome = run_streams(_unbatched(build_schedule("1f1b", 2, 2)))
    assert outcome.stuck == {0: 1, 1: 1}  # stage 0 sends F1 while stage 1 sends B0's gradient
    assert not outcome.mismatches
    assert run_streams(_unbatched(build_schedule("gpipe", 4, 8))).ok  # one direction at a time


def test_interleaving_needs_alternating_order_and_megatron_pair_steps():
    ring = build_schedule("interleaved", 3, 6, 2)

    def streams(schedule, *, odd):
        return {s: post_kernels(schedule, s, transfer_steps(
            schedule.actions[s], recv_from=stage_peers(schedule, s)[0], send_to=stage_peers(schedule, s)[1],
            odd=odd(s), sizes=schedule.step_sizes(s))) for s in range(schedule.num_stages)}

    assert run_streams(streams(ring, odd=lambda s: s % 2 == 1)).ok
    assert not run_streams(streams(ring, odd=lambda s: False)).ok  # every stage downstream first: a cycle
    single = dataclasses.replace(build_schedule("interleaved", 2, 4, 2), steps=None)  # one action per step
    assert run_streams(schedule_streams(single)).stuck


def test_1f1b_middle_stage_posts_what_megatron_core_posts():
    schedule = build_schedule("1f1b", 4, 4)
    names = []
    for step in stage_transfer_steps(schedule, 1):
        acts = schedule.actions[1]
        if isinstance(step, int):
            names.append(str(acts[step]))
        else:
            names.append("+".join([f"send {acts[i]}" for i in step.sends] + [f"recv {acts[i]}" for i in step.recvs])
                         + f"@{step.peer}")
    assert names == [
        "recv F0@0", "F0", "recv F1@0", "send F0@2",  # warm-up; an odd stage posts its upstream batch first
        "F1", "recv F2@0", "send F1@2", "F2",
        "send F2+recv B0@2", "B0",  # megatron-core's send_forward_recv_backward
        "send B0+recv F3@0", "F3",  # send_backward_recv_forward
        "send F3+recv B1@2", "B1",
        "send B1@0", "recv B2@2", "B2", "send B2@0", "recv B3@2", "B3", "send B3@0"]  # cool-down


def test_order_mismatch_is_reported_and_refused_without_tags():
    swapped = Schedule.from_text("stage 0: F0 F1 B0 B1\nstage 1: F1 F0 B0 B1\n")
    outcome = run_streams(schedule_streams(swapped))
    assert outcome.mismatches[0] == "transfer 0 from 0 to 1: sent ('act', 0, 0), received as ('act', 1, 0)"
    check_transfer_streams(build_schedule("1f1b", 4, 8), tags=False, backend="nccl")
    with pytest.raises(ScheduleError, match=r"sent \('act', 0, 0\), received as \('act', 1, 0\) \(nccl matches"):
        check_transfer_streams(swapped, tags=False, backend="nccl")


def test_a_stuck_custom_schedule_is_refused_even_with_tags():
    # stage 1 waits for F1 before running B0, whose gradient stage 0 waits for before sending F1
    stuck = Schedule.from_text("stage 0: F0 B0 F1 B1\nstage 1: F0 F1 B0 B1\n")
    assert run_streams(schedule_streams(stuck)).stuck
    with pytest.raises(ScheduleError, match="stage 0 would wait forever"):
        check_transfer_streams(stuck, tags=True, backend="gloo")


def test_model_counts_partial_progress_within_a_batch():
    # device a's batch holds a send to b and a receive from c; b can take its transfer at once, c
    # sends only after its first kernel (a receive from b, after b's send) completes
    kernels = {
        "a": [[StreamOp(send=True, peer="b", message=1), StreamOp(send=False, peer="c", message=3)]],
        "b": [[StreamOp(send=False, peer="a", message=1)], [StreamOp(send=True, peer="c", message=2)]],
        "c": [[StreamOp(send=False, peer="b", message=2)], [StreamOp(send=True, peer="a", message=3)]],
    }
    assert run_streams(kernels).ok
    lone = {"a": [[StreamOp(send=True, peer="b", message=1)]], "b": []}
    assert run_streams(lone).mismatches == ("a sends 1 transfers to b, which receives 0",)
