"""Tensor-parallel layers beyond megatron-core's 1D ones: AxoNN's 3D (x, y, z) linear layer.

Reference: docs/overlap.md. The grid (``Grid4D``) is pure; ``create_grid_groups`` makes the groups.
"""

from megatron_het.tp.grid import AXES, Grid4D
from megatron_het.tp.groups import GridGroups, create_grid_groups
from megatron_het.tp.linear3d import Linear3D, linear3d, linear3d_blocks, rows_of, weight_block

__all__ = ["AXES", "Grid4D", "GridGroups", "Linear3D", "create_grid_groups", "linear3d", "linear3d_blocks",
           "rows_of", "weight_block"]
