"""How many communicators each rank holds, said at start-up (issue #36).

On NCCL/RCCL every process group a rank belongs to is a communicator with its own device buffers
(hundreds of MB each at scale), so the count is a memory figure users check. The count is torch's
own registry of the groups this process is a member of (the world included), so every creator
counts: megatron-core's grids, pipeline boundaries, reduction groups, the bridge's inner groups.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["communicator_count", "communicators_line", "gathered_communicators_line"]


def communicator_count() -> int:
    """Process groups this rank is a member of, the world included."""
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)  # torch registers a group only on its members


def communicators_line(counts: Sequence[int]) -> str:
    """The start-up line from every rank's count (pure)."""
    lo, hi = min(counts), max(counts)
    if lo == hi:
        return f"communicators per rank: {hi} (process groups each rank belongs to, the world included)"
    return (f"communicators per rank: {lo} to {hi} (rank {list(counts).index(hi)} has {hi}; process groups each "
            f"rank belongs to, the world included)")


def gathered_communicators_line() -> str:
    """Every rank's count, gathered (collective); the line is the same on every rank."""
    import torch.distributed as dist

    counts: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, communicator_count())
    return communicators_line([int(c) for c in counts])
