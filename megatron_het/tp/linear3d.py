"""AxoNN's 3D tensor-parallel linear layer (Singh et al. 2024), on a ``Grid4D``.

``Y[m, n] = X[m, k] @ W[n, k]^T`` with rank ``(x, y, z)`` holding (``transpose=False``):

* input block ``X[rows z, in-features x]`` (``[m/gz, ..., k/gx]``),
* weight block ``W[out-features y, in-features x]`` sharded over z along its first dim
  (``[n/(gy*gz), k/gx]``),
* output block ``Y[rows z, out-features y]`` (``[m/gz, ..., n/gy]``), identical on every x rank.

forward:  ``W_blk = all_gather_z(W_shard)``; ``Y = all_reduce_x(X_blk @ W_blk^T)``.
backward: ``dX = all_reduce_y(dY @ W_blk)``; ``dW_shard = reduce_scatter_z(dY^T X_blk)``.
All three (and the forward all-reduce) are chunked and, with ``overlap``, asynchronous: each
chunk's collective runs while another chunk's GEMM computes (``_Linear3D``; AxoNN's OAG/OAR/ORS
within a layer).

``transpose=True`` swaps the roles of x and y (input features over y, output over x), so a
layer's output block is exactly the next transposed layer's input block: an MLP of a normal then a
transposed layer needs no redistribution between them (AxoNN's alternating layout). Bias is not
supported (AxoNN's transformer layers are bias-free); add one outside if needed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_het.comm.overlap_chunks import effective_chunks
from megatron_het.tp.grid import Grid4D
from megatron_het.tp.groups import GridGroups

__all__ = ["Linear3D", "linear3d", "linear3d_blocks", "rows_of", "weight_block"]


def _size(group: Any) -> int:
    return dist.get_world_size(group=group)


def _chunk_rows(shard_rows: int, gz: int, chunks: int) -> list[torch.Tensor]:
    """Row indices, in the gathered ``[shard_rows * gz, k]`` block, of each weight chunk.

    Chunk ``j`` is rows ``[j*cs, (j+1)*cs)`` of every z rank's shard, so its all-gather is one
    equal-size collective; gathered, it holds rows ``z*shard_rows + j*cs + r`` of the block (z-major).
    """
    c = effective_chunks(shard_rows, chunks)
    cs = shard_rows // c
    return [torch.cat([torch.arange(z * shard_rows + j * cs, z * shard_rows + (j + 1) * cs) for z in range(gz)])
            for j in range(c)]


def _wait(work: Any) -> None:
    if work is not None:  # blocking collectives return None
        work.wait()


class _Linear3D(torch.autograd.Function):
    """Every collective cut into ``chunks`` pieces; with ``overlap`` each piece is launched async
    and waited only when its result is needed, so it runs while another piece's GEMM computes:

    * forward: the all-gather of weight chunk ``j+1`` (z) || GEMM of chunk ``j``; the all-reduce of
      output chunk ``j`` (input-feature axis) || GEMM of chunk ``j+1`` (AxoNN's OAG, chunked);
    * backward: the all-reduce of input-gradient row chunk ``i`` (output-feature axis) || ``dX``
      GEMM of chunk ``i+1`` and every ``dW`` GEMM (OAR); the reduce-scatter of weight-gradient
      chunk ``j`` (z) || ``dW`` GEMM of chunk ``j+1`` (ORS).

    ``overlap=False`` runs the same chunked collectives blocking (isolates the gain of overlap);
    ``chunks=1, overlap=False`` is the plain layer. Only output columns / rows are split, never a
    GEMM's reduction dim, so outputs and input gradients are the same per-element products.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_shard: torch.Tensor, in_group: Any, out_group: Any,
                z_group: Any, overlap: bool, chunks: int) -> torch.Tensor:
        gz, g_in = _size(z_group), _size(in_group)
        ns = w_shard.shape[0]
        idx = _chunk_rows(ns, gz, chunks)
        cs = len(idx[0]) // gz
        w = w_shard.new_empty((ns * gz, *w_shard.shape[1:])) if gz > 1 else w_shard  # the gathered block
        gathered, ag_work = [], []
        for j in range(len(idx)):  # every weight all-gather launched up front, waited in order
            if gz > 1:
                buf = w_shard.new_empty((cs * gz, *w_shard.shape[1:]))
                ag_work.append(dist.all_gather_into_tensor(buf, w_shard[j * cs:(j + 1) * cs].contiguous(),
                                                           group=z_group, async_op=overlap))
            else:
                buf = w_shard[j * cs:(j + 1) * cs]
                ag_work.append(None)
            gathered.append(buf)
        y = x.new_empty((*x.shape[:-1], ns * gz))
        parts, ar_work = [], []
        for j, rows in enumerate(idx):
            _wait(ag_work[j])
            if gz > 1:
                w[rows] = gathered[j]
            part = torch.matmul(x, gathered[j].t())
            if g_in > 1:  # sum the partial products over input-feature blocks
                ar_work.append(dist.all_reduce(part, group=in_group, async_op=overlap))
            parts.append(part)
        for work in ar_work:
            _wait(work)
        for rows, part in zip(idx, parts, strict=True):
            y[..., rows] = part
        ctx.save_for_backward(x, w)  # keeps the gathered block (AxoNN can re-gather instead)
        ctx.groups, ctx.overlap, ctx.gz, ctx.idx = (in_group, out_group, z_group), overlap, gz, idx
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        _, out_group, z_group = ctx.groups
        overlap, gz, idx = ctx.overlap, ctx.gz, ctx.idx
        dy = dy.contiguous()
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dx = None
        ar_work: list[Any] = []
        if ctx.needs_input_grad[0]:
            dx = dy.new_empty((*dy.shape[:-1], w.shape[1]))
            dx2 = dx.view(-1, w.shape[1])
            n_rows = dx2.shape[0]
            c = effective_chunks(max(n_rows, 1), len(idx))
            step = n_rows // c
            for i in range(c):
                piece = dx2[i * step:(i + 1) * step]
                torch.matmul(dy2[i * step:(i + 1) * step], w, out=piece)
                if _size(out_group) > 1:
                    ar_work.append(dist.all_reduce(piece, group=out_group, async_op=overlap))
        dw_shard = None
        rs_work: list[Any] = []
        if ctx.needs_input_grad[1]:  # runs while dX is being all-reduced
            cs = len(idx[0]) // gz
            dw_shard = w.new_empty((w.shape[0] // gz, w.shape[1]))
            for j, rows in enumerate(idx):
                dw = dy2[:, rows].t().matmul(x2)
                if gz > 1:
                    rs_work.append(dist.reduce_scatter_tensor(dw_shard[j * cs:(j + 1) * cs], dw, group=z_group,
                                                              async_op=overlap))
                else:
                    dw_shard[rows] = dw
        for work in (*ar_work, *rs_work):
            _wait(work)
        return dx, dw_shard, None, None, None, None, None


def _axes(transpose: bool) -> tuple[str, str]:
    """(axis splitting input features, axis splitting output features)."""
    return ("y", "x") if transpose else ("x", "y")


def linear3d(x: torch.Tensor, w_shard: torch.Tensor, groups: GridGroups, *, transpose: bool = False,
             overlap: bool = True, chunks: int = 4) -> torch.Tensor:
    """The 3D-parallel matmul on this rank's blocks (see the module docstring for the layout).

    ``chunks``: pieces per collective (the largest divisor of the shard's rows ``<= chunks``);
    ``overlap``: launch them async and overlap them with the other pieces' GEMMs."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks: must be an int >= 1, got {chunks!r} (limit 1). Fix: pass 1 for no chunking")
    in_axis, out_axis = _axes(transpose)
    return _Linear3D.apply(x, w_shard, groups.group(in_axis), groups.group(out_axis), groups.z, overlap, chunks)


def weight_block(in_features: int, out_features: int, grid: Grid4D, coords: dict[str, int], *,
                 transpose: bool = False) -> dict[str, tuple[slice, ...]]:
    """Pure: which slices of the full tensors the rank at ``coords`` of ``grid`` holds: ``weight`` (its
    z shard of the block, as ``(rows, cols)`` of the full ``[out, in]`` weight), ``input_features``,
    ``output_features``. Checkpoints and cross-layout gradient reduction use it without groups."""
    in_axis, out_axis = _axes(transpose)
    g_in, g_out, gz = (getattr(grid, in_axis), getattr(grid, out_axis), grid.z)
    if in_features % g_in:
        raise ValueError(f"in_features: {in_features} must be a multiple of the {in_axis} axis size {g_in}. "
                         f"Fix: choose a grid whose {in_axis} divides {in_features}")
    if out_features % (g_out * gz):
        raise ValueError(f"out_features: {out_features} must be a multiple of {out_axis}*z = {g_out}*{gz} = "
                         f"{g_out * gz} (the weight block is sharded over z). Fix: choose a grid that divides it")
    c = coords
    ki, no = in_features // g_in, out_features // g_out
    ns = no // gz
    row0 = c[out_axis] * no + c["z"] * ns
    return {
        "weight": (slice(row0, row0 + ns), slice(c[in_axis] * ki, (c[in_axis] + 1) * ki)),
        "input_features": (slice(c[in_axis] * ki, (c[in_axis] + 1) * ki),),
        "output_features": (slice(c[out_axis] * no, (c[out_axis] + 1) * no),),
    }


def linear3d_blocks(in_features: int, out_features: int, groups: GridGroups, *,
                    transpose: bool = False) -> dict[str, tuple[slice, ...]]:
    """``weight_block`` for this rank's groups.

    Rows of the input (dim 0) are split over z: ``rows_of(m)`` is the ``slice`` of ``m`` rows."""
    return weight_block(in_features, out_features, groups.grid, groups.coords, transpose=transpose)


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
                 overlap: bool = True, chunks: int = 4, full_weight: torch.Tensor | None = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.groups, self.transpose, self.overlap, self.chunks = groups, transpose, overlap, chunks
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
        return linear3d(x, self.weight, self.groups, transpose=self.transpose, overlap=self.overlap,
                        chunks=self.chunks)
