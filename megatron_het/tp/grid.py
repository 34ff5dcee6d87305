"""AxoNN's 4D process grid: three tensor-parallel axes (x, y, z) times data parallelism.

For one matmul ``Y[m, n] = X[m, k] @ W[n, k]^T`` (Singh et al. 2024, "A 4D hybrid algorithm to
scale parallel training to thousands of GPUs"):

* axis **x** splits the input features ``k`` (the forward partial products are all-reduced over x),
* axis **y** splits the output features ``n`` (input gradients are all-reduced over y in backward),
* axis **z** splits the rows ``m`` (tokens); each rank's weight block is further sharded over z
  and all-gathered before use, its gradient reduce-scattered back (a ZeRO-3 inside the layer),
* **data** replicas each run the whole grid on their share of the batch.

Rank order: x varies fastest, then y, then z, then data, so the x groups are the most local
(same node first) — the axis that communicates the most per step in the forward pass.
This module is pure (no processes); ``create_grid_groups`` in ``groups.py`` makes the groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["AXES", "Axis", "Grid4D"]

Axis = Literal["x", "y", "z", "data"]
AXES: tuple[Axis, ...] = ("x", "y", "z", "data")  # fastest-varying first


@dataclass(frozen=True, kw_only=True)
class Grid4D:
    """Sizes of the four process-grid axes; ``size`` ranks in all."""

    x: int  # ranks splitting each matmul's input features
    y: int  # ranks splitting each matmul's output features
    z: int  # ranks splitting rows (tokens); weights sharded over it
    data: int = 1  # data-parallel replicas of the x*y*z tensor-parallel grid

    def __post_init__(self) -> None:
        for axis in AXES:
            v = getattr(self, axis)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Grid4D.{axis}: must be an int >= 1, got {v!r} (limit 1). "
                                 f"Fix: pass a positive axis size, 1 for an unused axis")

    @property
    def size(self) -> int:
        return self.x * self.y * self.z * self.data

    @property
    def tensor_parallel(self) -> int:
        return self.x * self.y * self.z

    def stride(self, axis: Axis) -> int:
        """Rank distance between neighbours along ``axis``."""
        s = 1
        for a in AXES:
            if a == axis:
                return s
            s *= getattr(self, a)
        raise ValueError(f"axis: must be one of {AXES}, got {axis!r}. Fix: use x, y, z or data")

    def coords(self, rank: int) -> dict[str, int]:
        """``{"x": .., "y": .., "z": .., "data": ..}`` of ``rank`` (0-based within the grid)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank: must be in [0, {self.size}), got {rank} (limit {self.size - 1}). "
                             f"Fix: pass a rank inside the grid")
        out = {}
        for a in AXES:
            out[a] = rank % getattr(self, a)
            rank //= getattr(self, a)
        return out

    def axis_groups(self, axis: Axis) -> list[tuple[int, ...]]:
        """Every group along ``axis`` (ranks in axis order), in a deterministic order."""
        n, stride = getattr(self, axis), self.stride(axis)
        starts = [r for r in range(self.size) if self.coords(r)[axis] == 0]
        return [tuple(s + i * stride for i in range(n)) for s in starts]

    def axis_group_of(self, axis: Axis, rank: int) -> tuple[int, ...]:
        """The group along ``axis`` that contains ``rank``."""
        for g in self.axis_groups(axis):
            if rank in g:
                return g
        raise ValueError(f"rank: {rank} is not in the grid of {self.size} ranks. Fix: pass a rank in range")
