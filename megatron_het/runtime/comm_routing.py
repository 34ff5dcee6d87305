"""Which communicator a group of the runtime uses: native, or the cross-vendor bridge.

NVIDIA ranks speak NCCL and AMD ranks RCCL, and the two cannot join one communicator even though
torch calls both backends "nccl". So the decision is made on the *collective library* of each
rank's device type (from the cluster file), not on torch backend names: a group whose ranks span
islands of different libraries goes through ``megatron_het.comm``'s hierarchical group (native
inside each island, host-staged between leaders); any other group is a plain ``new_group``.
On CPU every island's torch backend is gloo, but a cluster file that emulates, say, A100 beside
MI250X still routes their shared groups through the bridge, so the same path is exercised here.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_het.cluster import ClusterSpec
from megatron_het.model.groups import group_options
from megatron_het.plan import Plan, rank_roles
from megatron_het.platform import HOST_LIBRARY, Accelerator

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RankPlacement:
    """For every rank of a plan: its island and that island's collective library."""

    island: Mapping[int, str]
    library: Mapping[int, str]  # the catalog's collective library of the rank's device type

    def spans_libraries(self, ranks: Sequence[int]) -> bool:
        return len({self.library[r] for r in ranks}) > 1


def rank_placement(plan: Plan, cluster: ClusterSpec | None) -> RankPlacement:
    """Pure. Without a cluster every rank counts as one library (no bridge)."""
    roles = rank_roles(plan)
    island = {r: role.island for r, role in roles.items()}
    if cluster is None:
        return RankPlacement(island=island, library={r: HOST_LIBRARY for r in roles})
    return RankPlacement(island=island,
                         library={r: cluster.island(i).device.collective_library for r, i in island.items()})


class NativeGroup:
    """A torch process group behind the same small interface as the bridge group."""

    kind = "native"

    def __init__(self, group) -> None:
        self.group = group

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)


class BridgedGroup:
    kind = "het-bridge"

    def __init__(self, het_group) -> None:
        self.het = het_group

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.het.all_reduce(tensor)


def new_reduction_group(ranks: Sequence[int], placement: RankPlacement, *, accelerator: Accelerator,
                        timeout: datetime.timedelta | None = None):
    """Collective over the world (every rank calls it, same order); None on non-members.

    ``accelerator`` chooses each island's torch backend (NCCL/RCCL on GPUs, gloo on CPU) and the
    bridge's host backend; ``timeout``: the run's one timeout for every group created (None:
    torch's 30-minute default)."""
    ranks = sorted(ranks)
    if placement.spans_libraries(ranks):
        het = new_bridge_group(ranks, placement, accelerator=accelerator, timeout=timeout)
        return BridgedGroup(het) if het is not None else None
    backend = accelerator.backend_for(placement.library[ranks[0]])
    group = dist.new_group(ranks, **group_options(timeout, backend, accelerator.eager_device))
    return NativeGroup(group) if dist.get_rank() in ranks else None


class ReductionGroups:
    """One reduction group per distinct set of ranks, shared by every bucket over that set.

    Megatron's DDP reduces all of a data-parallel group's buckets on one communicator; creating a
    group per bucket (as this runtime did) cost a 7B plan with --overlap-grad-reduce ~100 NCCL
    communicators per rank, each with its own device buffers. Called as ``groups(ranks)`` by the
    gradient synchronizer and the distributed optimizer, which visit their buckets in the same order
    on every rank, so the first request of each set (the creation) is in one world-wide order.
    Collective on a set's first request; None on non-members, as ``new_reduction_group``."""

    def __init__(self, placement: RankPlacement | None, *, accelerator: Accelerator,
                 timeout: datetime.timedelta | None = None) -> None:
        self.placement = placement  # None: one collective library (every group native)
        self.accelerator = accelerator
        self.timeout = timeout
        self._groups: dict[tuple[int, ...], object | None] = {}

    def __call__(self, ranks: Sequence[int]):
        key = tuple(sorted(ranks))
        if key not in self._groups:
            placement = self.placement or rank_placement_of(key)
            self._groups[key] = new_reduction_group(key, placement, accelerator=self.accelerator,
                                                    timeout=self.timeout)
        return self._groups[key]


def rank_placement_of(ranks: Sequence[int]) -> RankPlacement:
    """Ranks of one collective library (no cluster file): every group is native."""
    return RankPlacement(island={r: "" for r in ranks}, library={r: HOST_LIBRARY for r in ranks})


def new_bridge_group(ranks: Sequence[int], placement: RankPlacement, *, accelerator: Accelerator,
                     timeout: datetime.timedelta | None = None):
    """``megatron_het.comm``'s hierarchical (het bridge) group over ``ranks``: each island's native
    backend inside, host-staged between islands. Collective over the world; None on non-members."""
    from megatron_het.comm import IslandMembership, new_hierarchical_group

    ranks = sorted(ranks)
    libraries = {placement.island[r]: placement.library[r] for r in ranks}
    membership = IslandMembership(rank_to_island={r: placement.island[r] for r in ranks},
                                  island_backend=accelerator.island_backends(libraries))
    return new_hierarchical_group(ranks, membership, host_backend=accelerator.host_backend,
                                  **({} if timeout is None else {"timeout_s": timeout.total_seconds()}))


def path_counts(groups: Sequence[Sequence[int]], placement: RankPlacement) -> dict[str, int]:
    """How many of ``groups`` (rank lists) are native and how many go through the bridge (pure)."""
    bridged = sum(1 for ranks in groups if placement.spans_libraries(ranks))
    return {"native": len(groups) - bridged, "het-bridge": bridged}


def all_reduce_world(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce a small tensor (a loss, a squared norm, an overflow flag) over the whole world,
    through the host: the world spans every island, and on a GPU cluster of several vendors no
    device communicator does; the world's host backend does. In place; returns ``tensor``."""
    from megatron_het.platform import HOST_DEVICE

    host = tensor.to(HOST_DEVICE)
    dist.all_reduce(host, op=op)
    if host is not tensor:
        tensor.copy_(host)
    return tensor
