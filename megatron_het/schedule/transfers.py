"""Which pipeline transfers a rank posts together, and when: a schedule's action list compiled into
steps (pure; read by the executor and by the stream model alike).

megatron-core posts each schedule step's crossing transfers in one ``batch_isend_irecv``: in 1F1B,
after a forward, the activation's send with the receive of the gradient the next backward needs
(``send_forward_recv_backward``); in interleaved 1F1B, after each steady forward/backward pair, both
sends with both receives of the next pair. ``transfer_steps`` does the same for any action list cut
into steps (``Schedule.steps``): after each step, one batch per neighbour holding the sends of the
step's actions and the receives of the next step's actions; before the first step, its receives.
The executor waits for the batches that receive before the next step computes (``runtime/executor.py``).

With one communicator per boundary (``runtime/boundary_groups.py``) a middle stage's two neighbours
get two batches. Their order alternates with the stage (megatron-core's ``_p2p_ops`` rule): an even
stage posts its batch with the downstream neighbour first, an odd stage the upstream one. Posting
every stage's downstream batch first closes a cycle around interleaving's ring; looking further
ahead than one step puts a receive into a batch whose matching send the peer posts only after a
batch this one gates. ``stream_model`` finds both deadlocks; the tests keep them as counter-examples.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from megatron_het.schedule.types import Action, Schedule

__all__ = ["Post", "Step", "forward_only", "schedule_messages", "stage_peers", "stage_transfer_steps",
           "transfer_steps"]


@dataclass(frozen=True, kw_only=True)
class Post:
    """One batch of transfers with one neighbour: a single ``batch_isend_irecv`` on its communicator."""

    peer: Hashable  # the neighbour every transfer of the batch goes to or comes from
    sends: tuple[int, ...] = ()  # action indices whose result (activation or input gradient) is sent
    recvs: tuple[int, ...] = ()  # action indices whose input (activation or output gradient) is received


Step = Post | int  # a batch of transfers, or the index of the action computed at that point


def _downstream(action: Action, sent: bool) -> bool:
    """The transfer goes to / comes from the next stage: a forward's result, a backward's input."""
    return (action.kind == "F") == sent


def transfer_steps(actions: Sequence[Action], *, recv_from: Callable[[int], Hashable | None],
                   send_to: Callable[[int], Hashable | None], odd: bool,
                   sizes: Sequence[int] | None = None) -> tuple[Step, ...]:
    """Steps of ``actions``: ``recv_from(i)``/``send_to(i)`` is the neighbour action ``i`` receives
    its input from / sends its result to (None: none, e.g. the first stage's forward); ``odd``: the
    stage's index in its pipeline is odd; ``sizes``: actions per step (None: one each)."""
    bounds = [0, *itertools.accumulate(sizes if sizes is not None else (1,) * len(actions))]
    groups = [range(a, b) for a, b in zip(bounds, bounds[1:])]

    def posts(sends: Sequence[int], recvs: Sequence[int]) -> list[Post]:
        by_peer: dict[Hashable, tuple[list[int], list[int]]] = {}  # peer -> (sends, receives), first seen first
        downstream: set[Hashable] = set()  # peers that are the next stage (for one action at least)
        for sent, indices, peer_of in ((True, sends, send_to), (False, recvs, recv_from)):
            for i in indices:
                if (peer := peer_of(i)) is not None:
                    by_peer.setdefault(peer, ([], []))[0 if sent else 1].append(i)
                    if _downstream(actions[i], sent):
                        downstream.add(peer)
        # even stages: the downstream neighbour's batch first; odd stages: the upstream one's
        order = sorted(by_peer, key=lambda peer: (peer in downstream) == odd)
        return [Post(peer=peer, sends=tuple(by_peer[peer][0]), recvs=tuple(by_peer[peer][1])) for peer in order]

    steps: list[Step] = list(posts((), groups[0])) if groups else []
    for k, group in enumerate(groups):
        steps += list(group)
        steps += posts(group, groups[k + 1] if k + 1 < len(groups) else ())
    return tuple(steps)


def stage_transfer_steps(schedule: Schedule, stage: int) -> tuple[Step, ...]:
    """``transfer_steps`` of one stage of ``schedule``, peers in stage indices."""
    recv_from, send_to = stage_peers(schedule, stage)
    return transfer_steps(schedule.actions[stage], recv_from=recv_from, send_to=send_to, odd=stage % 2 == 1,
                          sizes=schedule.step_sizes(stage))


def stage_peers(schedule: Schedule, stage: int) -> tuple[Callable[[int], int | None], Callable[[int], int | None]]:
    """(recv_from, send_to) of ``stage``'s actions in stage indices, interleaving's wrap included:
    a forward receives from the previous virtual stage and sends to the next, a backward the reverse;
    W only computes."""
    p, v, acts = schedule.num_stages, schedule.num_chunks, schedule.actions[stage]

    def prev(c: int) -> int | None:
        return stage - 1 if stage > 0 else (p - 1 if c > 0 else None)

    def nxt(c: int) -> int | None:
        return stage + 1 if stage < p - 1 else (0 if c < v - 1 else None)

    def recv_from(i: int) -> int | None:
        a = acts[i]
        return prev(a.chunk) if a.kind == "F" else nxt(a.chunk) if a.kind in ("B", "BW") else None

    def send_to(i: int) -> int | None:
        a = acts[i]
        return nxt(a.chunk) if a.kind == "F" else prev(a.chunk) if a.kind in ("B", "BW") else None

    return recv_from, send_to


def schedule_messages(schedule: Schedule, stage: int, action: Action, *, sent: bool) -> tuple[str, int, int]:
    """What crosses a boundary for ``action`` of ``stage``: (``act``/``grad``, micro-batch, virtual stage
    on the boundary's upstream side). ``sent``: the action's result, else its input."""
    p, s, c = schedule.num_stages, stage, action.chunk
    forward = action.kind == "F"
    # a forward's input and a backward's result cross the boundary above virtual stage c*p + s - 1
    upstream = c * p + s - (1 if forward != sent else 0)
    return ("act" if forward else "grad", action.micro_batch, upstream)


def forward_only(steps: Sequence[Step], actions: Sequence[Action]) -> tuple[Step, ...]:
    """``steps`` without backward work: what an evaluation runs (the forwards in the same order, each
    transfer in the same batch position, so its order between every two devices is unchanged)."""
    out: list[Step] = []
    for step in steps:
        if isinstance(step, Post):
            post = Post(peer=step.peer, sends=tuple(i for i in step.sends if actions[i].kind == "F"),
                        recvs=tuple(i for i in step.recvs if actions[i].kind == "F"))
            if post.sends or post.recvs:
                out.append(post)
        elif actions[step].kind == "F":
            out.append(step)
    return tuple(out)
