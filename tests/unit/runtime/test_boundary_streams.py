"""Why every direction of a pipeline boundary gets its own group (runtime/boundary_groups.py).

NCCL and RCCL queue every send and receive of one group between two ranks on one stream, in issue
order, and a send completes only together with its receive. ``_stream_deadlock`` models exactly that
(host calls never block: each rank's compute stream and one stream per channel; a send waits for the
compute that made its tensor, a compute for the receive of its input) over the transfers the schedule
executor issues per action. With one channel per pair of ranks 1F1B deadlocks; with one per direction
no schedule the runtime runs on NCCL does.
"""

from __future__ import annotations

import pytest

from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.runtime.boundary_groups import groups_with, pair_directions, plan_directions
from megatron_het.schedule import build_schedule


def _programs(name: str, p: int, m: int) -> list[list[tuple]]:
    """Per stage, in issue order, what runtime/executor.py posts per action: (op, peer) with op
    "recv"/"compute"/"send"; F receives from the previous stage and sends to the next, B/BW receives
    from the next and sends to the previous, W only computes."""
    out = []
    for s, actions in enumerate(build_schedule(name, p, m).actions):
        ops = []
        for a in actions:
            if a.kind == "F":
                ops += [("recv", s - 1)] if s > 0 else []
                ops += [("compute", None)] + ([("send", s + 1)] if s < p - 1 else [])
            elif a.kind in ("B", "BW"):
                ops += [("recv", s + 1)] if s < p - 1 else []
                ops += [("compute", None)] + ([("send", s - 1)] if s > 0 else [])
            else:
                ops += [("compute", None)]
        out.append(ops)
    return out


def _stream_deadlock(programs: list[list[tuple]], channel) -> bool:
    """True when the ops cannot all complete; ``channel(src, dst)``: the group a transfer runs on."""
    streams: list[dict[object, list[int]]] = []  # per rank: stream key -> op indices in issue order
    for s, ops in enumerate(programs):
        st: dict[object, list[int]] = {}
        for i, (op, peer) in enumerate(ops):
            key = "compute" if op == "compute" else channel(s, peer) if op == "send" else channel(peer, s)
            st.setdefault(key, []).append(i)
        streams.append(st)
    done = [set() for _ in programs]

    def head(s, key):
        q = streams[s].get(key, [])
        return next((i for i in q if i not in done[s]), None)

    def ready(s, i):  # a send waits for the compute before it, a compute for the receive before it
        op = programs[s][i][0]
        prev = i - 1
        return op == "recv" or prev < 0 or prev in done[s] or programs[s][prev][0] not in (
            "compute" if op == "send" else "recv",)

    progress = True
    while progress:
        progress = False
        for s, ops in enumerate(programs):
            i = head(s, "compute")
            if i is not None and ready(s, i):
                done[s].add(i)
                progress = True
            for key in streams[s]:
                i = head(s, key)
                if i is None or ops[i][0] != "send" or not ready(s, i):
                    continue
                peer = ops[i][1]
                j = head(peer, key)
                if j is not None and programs[peer][j] == ("recv", s):
                    done[s].add(i)
                    done[peer].add(j)
                    progress = True
    return any(len(d) < len(ops) for d, ops in zip(done, programs))


def test_one_group_per_pair_deadlocks_1f1b():
    def pair(a, b):
        return frozenset((a, b))

    assert _stream_deadlock(_programs("1f1b", 2, 2), pair)
    assert _stream_deadlock(_programs("zb-h1", 4, 8), pair)
    assert not _stream_deadlock(_programs("gpipe", 4, 8), pair)  # all forwards first: one direction at a time


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "gpipe"])
def test_one_group_per_direction_never_deadlocks(name):
    for p in range(2, 6):
        for m in range(1, 9):
            assert not _stream_deadlock(_programs(name, p, m), lambda a, b: (a, b)), (name, p, m)


def _stage(ranks, layers):
    return StagePlan(island="cpu", device_type="CPU", ranks=tuple(ranks), layers=layers)


def test_plan_directions_are_both_ways_of_every_boundary_in_plan_order():
    plan = Plan(replicas=(ReplicaPlan(stages=(_stage([0, 1], (0, 2)), _stage([2], (2, 3)), _stage([3, 4], (3, 4))),
                                      num_micro_batches=2),
                          ReplicaPlan(stages=(_stage([5], (0, 4)),), num_micro_batches=2)),
                micro_batch_size=1, global_batch_size=4)
    assert plan_directions(plan) == [((0, 1), (2,)), ((2,), (0, 1)), ((2,), (3, 4)), ((3, 4), (2,))]
    groups = {d: f"g{k}" for k, d in enumerate(plan_directions(plan))}
    assert groups_with((2,), (0, 1), groups) == {"send_group": "g0", "recv_group": "g1"}  # stage 0 -> its next
    assert groups_with((0, 1), (2,), groups) == {"send_group": "g1", "recv_group": "g0"}  # stage 1 <- its prev
    assert groups_with((3, 4), (0, 1), groups) == {}  # not neighbours: the default group


def test_interleaving_adds_the_wrap_boundary_and_two_stages_share_their_directions():
    stages = (_stage([0], (0, 2)), _stage([1], (2, 4)))
    two = Plan(replicas=(ReplicaPlan(stages=stages, num_micro_batches=2),), micro_batch_size=1, global_batch_size=2,
               schedule="interleaved", virtual_pipeline_size=2)
    assert plan_directions(two) == [((0,), (1,)), ((1,), (0,))]  # the wrap 1 -> 0 is the backward direction
    assert pair_directions([((0,), (1,)), ((1,), (2,)), ((0,), (1,))]) == [((0,), (1,)), ((1,), (0,)),
                                                                          ((1,), (2,)), ((2,), (1,))]
