"""One process group per direction of every pipeline boundary (NCCL/RCCL would deadlock on one).

NCCL and RCCL run every send and receive between two ranks of one group on one stream, in issue
order, and a send completes only as its receiver drains it (beyond the library's small buffer: any
real activation). In 1F1B both sides of a boundary reach a send at once: stage s sends micro-batch
k+1's activation while stage s+1 sends micro-batch k's gradient, each queued ahead of the receive
that would match the other's, so neither completes. Megatron avoids this by batching each send with
the next receive (``batch_isend_irecv``); the schedule executor here posts each send as soon as its
tensor exists, so every direction of every boundary gets a group of its own instead: a one-way queue
per direction, whose order ``boundary.order_mismatches`` checks against the schedule. gloo matches
messages by tag, but the same groups are used there, so CPU tests run the GPU's code path.

Directions are keyed by the ordered pair (sender stage's ranks, receiver stage's ranks); a boundary
whose two stages use different collective libraries goes through the het bridge and gets none.
Enumerating the pairs is pure (the same list on every rank); creating the groups is collective.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence

import torch.distributed as dist

from megatron_het.model.groups import group_options
from megatron_het.plan import Plan

__all__ = ["Direction", "create_direction_groups", "groups_with", "pair_directions", "plan_boundaries",
           "plan_directions"]

# (sender stage's ranks, receiver stage's ranks), each in TP order
Direction = tuple[tuple[int, ...], tuple[int, ...]]


def plan_boundaries(plan: Plan) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """(replica, upstream stage, its ranks, the downstream stage's ranks) of every boundary of ``plan``,
    in plan order; interleaving adds each replica's last stage -> stage 0 boundary (upstream p - 1).
    Pure: every rank gets the same list."""
    out = []
    for r, replica in enumerate(plan.replicas):
        p = len(replica.stages)
        for s in range(p if plan.virtual_pipeline_size > 1 and p > 1 else p - 1):
            out.append((r, s, tuple(replica.stages[s].ranks), tuple(replica.stages[(s + 1) % p].ranks)))
    return out


def pair_directions(pairs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> list[Direction]:
    """Both directions of each (upstream ranks, downstream ranks) boundary, first seen first (pure)."""
    out: dict[Direction, None] = {}  # ordered and de-duplicated in one pass (thousands at scale)
    for a, b in pairs:
        out.setdefault((tuple(a), tuple(b)))
        out.setdefault((tuple(b), tuple(a)))
    return list(out)


def plan_directions(plan: Plan) -> list[Direction]:
    """Every direction of every boundary of ``plan`` (``plan_boundaries``), in plan order."""
    return pair_directions((up, down) for _, _, up, down in plan_boundaries(plan))


def create_direction_groups(directions: Sequence[Direction], *, spans_libraries, backend: str | None,
                            timeout: datetime.timedelta | None = None, device_id=None) -> dict[Direction, object]:
    """Direction -> its group, for the directions this rank sends or receives on. Collective over the
    world: every rank calls it with the same ``directions`` and creates every group in that order.
    ``spans_libraries(ranks)``: the boundary goes through the het bridge (no group); ``backend``: the
    accelerator's torch backend for device tensors (None: the world's default); ``device_id``:
    ``Accelerator.eager_device`` (GPU groups created at once)."""
    rank = dist.get_rank()
    out: dict[Direction, object] = {}
    for d in directions:
        ranks = sorted({*d[0], *d[1]})
        if spans_libraries(ranks):
            continue
        group = dist.new_group(ranks, **group_options(timeout, backend, device_id))
        if rank in ranks:
            out[d] = group
    return out


def groups_with(peer: Sequence[int], mine: Sequence[int], groups: Mapping[Direction, object]) -> dict[str, object]:
    """``Neighbour`` keyword arguments: the group this rank sends to ``peer`` on and the one it receives
    from ``peer`` on (absent: the default group, e.g. a bridged boundary or a test without groups)."""
    out = {}
    send, recv = groups.get((tuple(mine), tuple(peer))), groups.get((tuple(peer), tuple(mine)))
    if send is not None:
        out["send_group"] = send
    if recv is not None:
        out["recv_group"] = recv
    return out
