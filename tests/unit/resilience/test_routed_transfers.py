"""Routed schedules' transfers under NCCL's weakest promise (resilience/routed_transfers.py).

An instance serving several pipelines can be upstream of a peer on one and downstream on another.
Megatron's one-step look-ahead batching (schedule/transfers.py) then closes cycles of blocked
batches; posting every transfer alone in the global (production time, message) order does not, for
every routing of the unit grid with up to two failures, in training and in evaluation.
"""

from __future__ import annotations

import itertools

from megatron_het.resilience.routed_schedule import routed_schedule
from megatron_het.resilience.routed_transfers import routed_peers, routed_transfer_steps
from megatron_het.resilience.routing import ReroutingError, reroute
from megatron_het.schedule.stream_model import StreamOp, run_streams
from megatron_het.schedule.transfers import Post, forward_only, transfer_steps

from support.resilience_grid import grid


def _kernels(routing, schedule, steps_of, *, evaluate=False):
    out = {}
    for key, acts in schedule.actions.items():
        _, _, message = routed_peers(routing, schedule, key)
        steps = steps_of(key)
        if evaluate:
            steps = forward_only(steps, acts)
        out[key] = [[StreamOp(send=True, peer=s.peer, message=message(i, True)) for i in s.sends] +
                    [StreamOp(send=False, peer=s.peer, message=message(i, False)) for i in s.recvs]
                    for s in steps if isinstance(s, Post)]
    return out


def _routings():
    for replicas, stages, micro in itertools.product((2, 3), (2, 3), (2, 4)):
        plan = grid(replicas, stages, micro)
        for failed in itertools.chain(*(itertools.combinations(range(replicas * stages), n) for n in (0, 1, 2))):
            for spread in (1, 2):
                try:
                    yield (replicas, stages, micro, failed, spread), reroute(plan, failed, spread=spread)
                except ReroutingError:  # a stage lost on every replica
                    continue


def test_every_routed_schedule_completes_in_training_and_evaluation():
    count = 0
    for case, routing in _routings():
        for split in (False, True):
            schedule = routed_schedule(routing, split_backward=split)
            for evaluate in (False, True):
                outcome = run_streams(_kernels(routing, schedule, lambda key: routed_transfer_steps(
                    routing, schedule, key), evaluate=evaluate))
                assert outcome.ok, (case, split, evaluate, outcome)
                count += 1
    assert count > 500


def test_every_action_is_computed_once_in_list_order_after_its_input():
    routing = reroute(grid(3, 3, 4), (4,))
    schedule = routed_schedule(routing, split_backward=True)
    for key, acts in schedule.actions.items():
        steps = routed_transfer_steps(routing, schedule, key)
        assert [s for s in steps if isinstance(s, int)] == list(range(len(acts)))
        recv_from, _, _ = routed_peers(routing, schedule, key)
        received = set()
        for s in steps:
            if isinstance(s, Post):
                assert len(s.sends) + len(s.recvs) == 1  # every transfer alone
                received.update(s.recvs)
            elif recv_from(s) is not None:
                assert s in received, (key, acts[s])


def test_look_ahead_batching_deadlocks_a_routed_schedule():
    routing = reroute(grid(2, 2, 4), (1,))  # replica 0's stage 1 is covered by replica 1's
    schedule = routed_schedule(routing, split_backward=True)

    def batched(key):
        recv_from, send_to, _ = routed_peers(routing, schedule, key)
        return transfer_steps(schedule.actions[key], recv_from=recv_from, send_to=send_to, odd=key[1] % 2 == 1)

    assert run_streams(_kernels(routing, schedule, batched)).stuck
    assert run_streams(_kernels(routing, schedule, lambda key: routed_transfer_steps(routing, schedule, key))).ok
