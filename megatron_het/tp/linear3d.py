"""AxoNN's 3D tensor-parallel linear layer (Singh et al. 2024), on a ``Grid4D``.

``Y[m, n] = X[m, k] @ W[n, k]^T`` with rank ``(x, y, z)`` holding (``transpose=False``):

* input block ``X[rows z, in-features x]`` (``[m/gz, ..., k/gx]``),
* weight block ``W[out-features y, in-features x]`` sharded over z along its first dim
  (``[n/(gy*gz), k/gx]``),
* output block ``Y[rows z, out-features y]`` (``[m/gz, ..., n/gy]``), identical on every x rank.

forward:  ``W_blk = all_gather_z(W_shard)``; ``Y = all_reduce_x(X_blk @ W_blk^T)``.
backward: ``dX = all_reduce_y(dY @ W_blk)`` — async, overlapped with ``dW_blk = dY^T X_blk``
(AxoNN's "OAR"); ``dW_shard = reduce_scatter_z(dW_blk)``.

``transpose=True`` swaps the roles of x and y (input features over y, output over x), so a
layer's output block is exactly the next transposed layer's input block: an MLP of a normal then a
transposed layer needs no redistribution between them (AxoNN's alternating layout). Bias is not
supported (AxoNN's transformer layers are bias-free); add one outside if needed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_het.tp.groups import GridGroups

__all__ = ["Linear3D", "linear3d", "linear3d_blocks", "rows_of"]


def _size(group: Any) -> int:
    return dist.get_world_size(group=group)


class _Linear3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w_shard: torch.Tensor, in_group: Any, out_group: Any,
                z_group: Any, overlap: bool) -> torch.Tensor:
        gz = _size(z_group)
        if gz > 1:
            w = w_shard.new_empty((w_shard.shape[0] * gz, *w_shard.shape[1:]))
            dist.all_gather_into_tensor(w, w_shard.contiguous(), group=z_group)
        else:
            w = w_shard
        y = torch.matmul(x, w.t())
        if _size(in_group) > 1:
            dist.all_reduce(y, group=in_group)  # sum the partial products over input-feature blocks
        ctx.save_for_backward(x, w)  # keeps the gathered block (AxoNN can re-gather instead)
        ctx.groups, ctx.overlap, ctx.gz = (in_group, out_group, z_group), overlap, gz
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        _, out_group, z_group = ctx.groups
        dy = dy.contiguous()
        dx = work = None
        if ctx.needs_input_grad[0]:
            dx = torch.matmul(dy, w)
            if _size(out_group) > 1:
                work = dist.all_reduce(dx, group=out_group, async_op=ctx.overlap)
        dw_shard = None
        if ctx.needs_input_grad[1]:  # runs while dX is being all-reduced
            dw = dy.reshape(-1, dy.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
            if ctx.gz > 1:
                dw_shard = dw.new_empty((dw.shape[0] // ctx.gz, *dw.shape[1:]))
                dist.reduce_scatter_tensor(dw_shard, dw, group=z_group)
            else:
                dw_shard = dw
        if work is not None:
            work.wait()
        return dx, dw_shard, None, None, None, None


def _axes(transpose: bool) -> tuple[str, str]:
    """(axis splitting input features, axis splitting output features)."""
    return ("y", "x") if transpose else ("x", "y")


def linear3d(x: torch.Tensor, w_shard: torch.Tensor, groups: GridGroups, *, transpose: bool = False,
             overlap: bool = True) -> torch.Tensor:
    """The 3D-parallel matmul on this rank's blocks (see the module docstring for the layout)."""
    in_axis, out_axis = _axes(transpose)
    return _Linear3D.apply(x, w_shard, groups.group(in_axis), groups.group(out_axis), groups.z, overlap)


def linear3d_blocks(in_features: int, out_features: int, groups: GridGroups, *,
                    transpose: bool = False) -> dict[str, tuple[slice, ...]]:
    """Which slices of the full tensors this rank holds: ``weight`` (its z shard of the block, as
    ``(rows, cols)`` of the full ``[out, in]`` weight), ``input_features``, ``output_features``.

    Rows of the input (dim 0) are split over z: ``input_rows(m)`` is ``slice`` of ``m`` rows."""
    in_axis, out_axis = _axes(transpose)
    g_in, g_out, gz = (getattr(groups.grid, in_axis), getattr(groups.grid, out_axis), groups.grid.z)
    if in_features % g_in:
        raise ValueError(f"in_features: {in_features} must be a multiple of the {in_axis} axis size {g_in}. "
                         f"Fix: choose a grid whose {in_axis} divides {in_features}")
    if out_features % (g_out * gz):
        raise ValueError(f"out_features: {out_features} must be a multiple of {out_axis}*z = {g_out}*{gz} = "
                         f"{g_out * gz} (the weight block is sharded over z). Fix: choose a grid that divides it")
    c = groups.coords
    ki, no = in_features // g_in, out_features // g_out
    ns = no // gz
    row0 = c[out_axis] * no + c["z"] * ns
    return {
        "weight": (slice(row0, row0 + ns), slice(c[in_axis] * ki, (c[in_axis] + 1) * ki)),
        "input_features": (slice(c[in_axis] * ki, (c[in_axis] + 1) * ki),),
        "output_features": (slice(c[out_axis] * no, (c[out_axis] + 1) * no),),
    }


def rows_of(rows: int, groups: GridGroups) -> slice:
    """The rows (dim 0) of the full input this rank's z coordinate holds."""
    gz = groups.grid.z
    if rows % gz:
        raise ValueError(f"rows: {rows} must be a multiple of the z axis size {gz}. "
                         f"Fix: make the token count divisible by {gz}")
    per = rows // gz
    return slice(groups.coords["z"] * per, (groups.coords["z"] + 1) * per)


class Linear3D(torch.nn.Module):
    """A bias-free linear layer whose weight is spread over a 3D tensor-parallel grid.

    ``full_weight`` (``[out, in]``, identical on every rank) initialises the shard, so tests and
    checkpoints can compare against a single-process layer; otherwise the full weight is drawn
    from ``torch.Generator().manual_seed(seed)`` (same values on every rank, any grid).
    """

    def __init__(self, in_features: int, out_features: int, *, groups: GridGroups, transpose: bool = False,
                 overlap: bool = True, full_weight: torch.Tensor | None = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.groups, self.transpose, self.overlap = groups, transpose, overlap
        self.blocks = linear3d_blocks(in_features, out_features, groups, transpose=transpose)
        if full_weight is None:
            g = torch.Generator().manual_seed(seed)
            full_weight = torch.randn(out_features, in_features, generator=g, dtype=torch.float64)
            full_weight = (full_weight / in_features ** 0.5).to(dtype)
        if tuple(full_weight.shape) != (out_features, in_features):
            raise ValueError(f"full_weight.shape: must be {(out_features, in_features)}, got "
                             f"{tuple(full_weight.shape)}. Fix: pass the [out_features, in_features] weight")
        self.weight = torch.nn.Parameter(full_weight[self.blocks["weight"]].to(dtype).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: this rank's ``[rows/z, ..., in/g_in]`` block; returns ``[rows/z, ..., out/g_out]``."""
        return linear3d(x, self.weight, self.groups, transpose=self.transpose, overlap=self.overlap)
