"""What a rank of a 3D tensor-parallel stage (plan ``tp_grid``) holds, for the gradient reduction.

Pure (no process groups): a 3D stage's parameters become ``runtime/grad_sync.Holding``s with
``grid`` set, whose full shapes come from the local shapes and the grid's layout
(checkpoint/tp_layout.grid_index): linear weights ``[n/(gy*gz), k/gx]`` blocks (transposed:
``[n/(gx*gz), k/gy]``), norms the x block, biases the output block; the embedding, final norm and
output layer are megatron-core at TP = gy (split over y along ``partition_dim``), copied on every x
and z rank.
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron_het.checkpoint.tp_layout import grid_full_shape, is_glu
from megatron_het.runtime.grad_sync import Holding

__all__ = ["create_plan_grid_groups", "grid_full_shape", "grid_pg_collection", "tp3d_holdings"]


def tp3d_holdings(params: Mapping[str, tuple[tuple[int, ...], int | None]], *, rank: int, grid_rank: int,
                  stage_key: tuple[int, int], grid: tuple[int, int, int], gated: bool = False) -> list[Holding]:
    """Pure: the holdings of world rank ``rank`` = index ``grid_rank`` (x fastest) of a 3D stage.
    ``params``: global name -> (local shape, megatron's partition_dim or None), in forward order."""
    gx, gy, gz = grid
    size = gx * gy * gz
    if not 0 <= grid_rank < size:
        raise ValueError(f"grid_rank: must be in [0, {size}) for grid {list(grid)}, got {grid_rank} "
                         f"(limit {size - 1}). Fix: pass the rank's index in its stage")
    return [Holding(name=name, rank=rank, stage_key=stage_key, tp_rank=grid_rank, tp_size=size,
                    partition_dim=dim, full_shape=grid_full_shape(name, tuple(shape), grid, dim),
                    glu=is_glu(name, gated), grid=tuple(grid))
            for name, (shape, dim) in params.items()]


def create_plan_grid_groups(plan, *, timeout=None):
    """Every 3D stage's axis groups (collective: every rank creates every group, in plan order);
    returns this rank's ``tp.groups.GridGroups`` or None when its stage is 1D. A 3D stage's ranks
    are consecutive (runtime/stage_groups.check_contiguous_stages), in grid order."""
    from megatron_het.tp.grid import Grid4D
    from megatron_het.tp.groups import create_grid_groups

    mine = None
    for replica in plan.replicas:
        for stage in replica.stages:
            if stage.tp_grid is None:
                continue
            gx, gy, gz = stage.tp_grid
            groups = create_grid_groups(Grid4D(x=gx, y=gy, z=gz), rank_offset=stage.ranks[0], timeout=timeout)
            if groups is not None:
                mine = groups
    return mine


def grid_pg_collection(pgc, groups):
    """The stage's megatron-core collection with the grid's y group as its tensor-parallel group
    (a 3D stage runs megatron-core at TP = gy; pipeline/data groups stay the stage's size-1 ones)."""
    import copy

    out = copy.copy(pgc)
    for attr in ("tp", "mp", "tp_cp", "tp_dp_cp", "expt_tp", "tp_ep_pp"):
        setattr(out, attr, groups.y)
    return out
