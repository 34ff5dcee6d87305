"""When each instance of a routed schedule posts its pipeline transfers: in simulated-time order.

A routed schedule mixes pipelines: an instance can be upstream of a peer on one pipeline and
downstream of it on another, so megatron's one-step look-ahead (``schedule/transfers.py``) can
close a cycle of blocked batches (the stream model finds it in a third of the routings of the unit
grid). Here every transfer is posted alone, and every instance posts its transfers in one global
order: the simulated time its result was produced, then the message. The first pending transfer in
that order is next on both of its ends (whatever an instance computed before producing it was fed
by earlier transfers), so under NCCL's weakest promise (``schedule/stream_model.py``) no instance
waits forever. Computes sit between the transfers at their simulated start times.
"""

from __future__ import annotations

from megatron_het.resilience.routed_schedule import RoutedSchedule
from megatron_het.resilience.routing import InstanceKey, Routing
from megatron_het.schedule import ScheduleError
from megatron_het.schedule.transfers import Post, Step

__all__ = ["routed_peers", "routed_transfer_steps"]

def routed_peers(routing: Routing, schedule: RoutedSchedule, key: InstanceKey):
    """(recv_from, send_to, message) of instance ``key``'s actions: neighbour instances on each action's
    pipeline, and what crosses (``act``/``grad``, micro-batch, the boundary's upstream instance)."""
    acts = schedule.actions[key]
    pipe_of = {g: pipe for pipe in routing.pipelines for g in pipe.micro_batches}

    def hops(i: int) -> tuple[tuple[InstanceKey, ...], int]:
        pipe = pipe_of[acts[i].micro_batch]
        return pipe.hops, pipe.hops.index(key)

    def side(i: int, downstream: bool) -> InstanceKey | None:
        chain, s = hops(i)
        t = s + 1 if downstream else s - 1
        return chain[t] if 0 <= t < len(chain) else None

    def recv_from(i: int) -> InstanceKey | None:
        kind = acts[i].kind
        return side(i, False) if kind == "F" else side(i, True) if kind == "B" else None

    def send_to(i: int) -> InstanceKey | None:
        kind = acts[i].kind
        return side(i, True) if kind == "F" else side(i, False) if kind == "B" else None

    def message(i: int, sent: bool) -> tuple:
        chain, s = hops(i)
        forward = acts[i].kind == "F"
        return ("act" if forward else "grad", acts[i].micro_batch, chain[s - (1 if forward != sent else 0)])

    return recv_from, send_to, message


def routed_transfer_steps(routing: Routing, schedule: RoutedSchedule, key: InstanceKey) -> tuple[Step, ...]:
    """Instance ``key``'s steps: its actions in list order, each transfer alone, transfers in the
    global (production time, message) order, each before the first compute that starts after it."""
    acts = schedule.actions[key]
    recv_from, send_to, message = routed_peers(routing, schedule, key)

    def produced(i: int, sent: bool) -> float:  # the producer of a received input: same kind, on the peer
        where = key if sent else recv_from(i)
        return schedule.times[(where, acts[i].kind, acts[i].micro_batch)][1]

    transfers = sorted([((produced(i, False), message(i, False)), False, i) for i in range(len(acts))
                        if recv_from(i) is not None] +
                       [((produced(i, True), message(i, True)), True, i) for i in range(len(acts))
                        if send_to(i) is not None])
    def post(sent: bool, j: int) -> Post:
        return Post(peer=send_to(j), sends=(j,)) if sent else Post(peer=recv_from(j), recvs=(j,))

    steps: list[Step] = []
    received: set[int] = set()
    t = 0
    for i, a in enumerate(acts):
        start = schedule.times[(key, a.kind, a.micro_batch)][0]
        while t < len(transfers) and transfers[t][0][0] <= start and (not transfers[t][1] or transfers[t][2] < i):
            _, sent, j = transfers[t]
            steps.append(post(sent, j))
            received.update(() if sent else (j,))
            t += 1
        if recv_from(i) is not None and i not in received:
            raise ScheduleError(field="routing", value=str(a), problem=f"instance {key} would compute {a} before "
                                "receiving its input (the simulated times are not in dependency order)",
                                fix="report this routing")
        steps.append(i)
    steps += [post(sent, j) for _, sent, j in transfers[t:]]
    return tuple(steps)
