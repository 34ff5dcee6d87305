"""One process group per pipeline boundary, both directions on it (what its batches are posted on).

The schedule executor posts each step's transfers with one neighbour as one ``batch_isend_irecv``
(``schedule/transfers.py``), as megatron-core does: a send and the receive that crosses it are one
grouped NCCL/RCCL kernel, so both directions of a boundary can share its communicator. (Before the
transfers were batched every direction needed a group of its own: two unbatched sends crossing on
one NCCL group deadlock in 1F1B.) Whether every device's batches can complete under NCCL's weakest
promise, one resident kernel per device, is checked by ``schedule/stream_model.py`` at start-up.

A boundary is keyed by the sorted ranks of its two stages; the wrap boundary of a two-stage
interleaved pipeline is the same pair of stages, so it shares their group. A boundary whose two
stages use different collective libraries goes through the het bridge and gets none. Enumerating
the boundaries is pure (the same list on every rank); creating the groups is collective.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence

import torch.distributed as dist

from megatron_het.model.groups import group_options
from megatron_het.plan import Plan

__all__ = ["BoundaryKey", "boundary_key", "create_boundary_groups", "group_with", "pair_boundaries",
           "plan_boundaries", "plan_boundary_keys"]

BoundaryKey = tuple[int, ...]  # the sorted ranks of a boundary's two stages


def boundary_key(a: Sequence[int], b: Sequence[int]) -> BoundaryKey:
    """The key of the boundary between stages of ranks ``a`` and ``b`` (either order)."""
    return tuple(sorted({*a, *b}))


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


def pair_boundaries(pairs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> list[BoundaryKey]:
    """The boundary of each (upstream ranks, downstream ranks) pair, first seen first (pure)."""
    out: dict[BoundaryKey, None] = {}  # ordered and de-duplicated in one pass (thousands at scale)
    for a, b in pairs:
        out.setdefault(boundary_key(a, b))
    return list(out)


def plan_boundary_keys(plan: Plan) -> list[BoundaryKey]:
    """Every boundary of ``plan`` (``plan_boundaries``), in plan order."""
    return pair_boundaries((up, down) for _, _, up, down in plan_boundaries(plan))


def create_boundary_groups(boundaries: Sequence[BoundaryKey], *, spans_libraries, backend: str | None,
                           timeout: datetime.timedelta | None = None, device_id=None) -> dict[BoundaryKey, object]:
    """Boundary -> its group, for the boundaries this rank is part of. Collective over the world: every
    rank calls it with the same ``boundaries`` and creates every group in that order.
    ``spans_libraries(ranks)``: the boundary goes through the het bridge (no group); ``backend``: the
    accelerator's torch backend for device tensors (None: the world's default); ``device_id``:
    ``Accelerator.eager_device`` (GPU groups created at once, so a batch may span part of one)."""
    rank = dist.get_rank()
    out: dict[BoundaryKey, object] = {}
    for ranks in boundaries:
        if spans_libraries(list(ranks)):
            continue
        group = dist.new_group(list(ranks), **group_options(timeout, backend, device_id))
        if rank in ranks:
            out[ranks] = group
    return out


def group_with(peer: Sequence[int], mine: Sequence[int], groups: Mapping[BoundaryKey, object]) -> dict[str, object]:
    """``Neighbour`` keyword arguments: the group of this rank's boundary with ``peer`` (absent: the
    default group, e.g. a bridged boundary or a test without groups)."""
    group = groups.get(boundary_key(peer, mine))
    return {"group": group} if group is not None else {}
