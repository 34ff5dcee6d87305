"""Process groups for a ``Grid4D`` (the one collective step; everything else is pure)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_het.tp.grid import AXES, Grid4D

__all__ = ["GridGroups", "create_grid_groups"]


@dataclass(frozen=True, kw_only=True)
class GridGroups:
    """This rank's groups along each axis of a grid, and its coordinates."""

    grid: Grid4D  # the grid the groups were made for
    coords: dict[str, int]  # this rank's position on each axis
    x: Any  # process group along x (a group of one rank when the axis has size 1)
    y: Any  # process group along y
    z: Any  # process group along z
    data: Any  # process group along the data axis

    def group(self, axis: str) -> Any:
        return getattr(self, axis)


def create_grid_groups(grid: Grid4D, *, rank_offset: int = 0,
                       timeout: datetime.timedelta | None = None) -> GridGroups | None:
    """Create every axis group of ``grid`` (ranks ``rank_offset ..``); collective over the world.
    ``timeout``: the run's group timeout (None: torch's default).

    Every rank of the world must call it with the same arguments (``new_group`` is collective).
    Returns None on ranks outside the grid.
    """
    world = dist.get_world_size()
    if rank_offset < 0 or rank_offset + grid.size > world:
        raise ValueError(f"rank_offset: the grid of {grid.size} ranks at offset {rank_offset} does not fit "
                         f"in a world of {world} (limit {world - grid.size}). Fix: shrink the grid or the offset")
    rank = dist.get_rank()
    mine: dict[str, Any] = {}
    for axis in AXES:
        for ranks in grid.axis_groups(axis):
            global_ranks = [rank_offset + r for r in ranks]
            g = dist.new_group(global_ranks, **({} if timeout is None else {"timeout": timeout}))
            if rank in global_ranks:
                mine[axis] = g
    if not rank_offset <= rank < rank_offset + grid.size:
        return None
    return GridGroups(grid=grid, coords=grid.coords(rank - rank_offset), **mine)
