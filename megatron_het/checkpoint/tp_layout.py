"""Where a rank's tensor-parallel shard sits inside the full tensor.

Most TP-partitioned tensors are plain chunks along ``partition_dim``. The first MLP projection of a
gated (SwiGLU) model is not: megatron-core stores ``linear_fc1`` as [gate; up] and gives TP rank r
[gate_r; up_r] (megatron's own checkpoints split it with ``apply_swiglu_sharded_factory``). Every
place that slices, joins or writes shards goes through these functions so both layouts stay right
for any pair of TP sizes.
"""

from __future__ import annotations

import re

import torch

from megatron_het.tp.grid import Grid4D
from megatron_het.tp.linear3d import weight_block

# A gated MLP's fused [gate; up] projection: the dense MLP's, each MoE expert's and the shared expert's
# (megatron-core builds all three as transformer/mlp.MLP, fc1 with stride 2: [gate_r; up_r] per TP rank)
GLU_FC1 = re.compile(r"\.mlp\.(?:experts\.local_experts\.\d+\.|shared_experts\.)?linear_fc1\.(?:weight|bias)$")
# A 3D tensor-parallel stage (plan tp_grid, AxoNN's layout): the transformer layer's four linear
# weights, by name suffix, and whether each runs transposed (input features over y, output over x).
GRID_LINEARS = {".self_attention.linear_qkv.weight": False, ".self_attention.linear_proj.weight": True,
                ".mlp.linear_fc1.weight": False, ".mlp.linear_fc2.weight": True}


def is_glu(name: str, gated: bool) -> bool:
    """True for the fused gate/up projection of a gated MLP."""
    return gated and GLU_FC1.search(name) is not None


def full_views(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int, glu: bool) -> list[torch.Tensor]:
    """Views of ``full`` that rank ``tp_rank`` holds, in its local order (one, or gate and up)."""
    if not glu:
        return [torch.chunk(full, tp_size, dim=dim)[tp_rank]]
    gate, up = torch.chunk(full, 2, dim=dim)
    return [torch.chunk(gate, tp_size, dim=dim)[tp_rank], torch.chunk(up, tp_size, dim=dim)[tp_rank]]


def local_pieces(local: torch.Tensor, dim: int, glu: bool) -> list[torch.Tensor]:
    """The local shard cut the same way as ``full_views``."""
    return list(torch.chunk(local, 2, dim=dim)) if glu else [local]


def slice_full(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int, glu: bool) -> torch.Tensor:
    return torch.cat(full_views(full, dim, tp_rank, tp_size, glu), dim=dim)


def write_local(full: torch.Tensor, local: torch.Tensor, dim: int, tp_rank: int, tp_size: int, glu: bool) -> None:
    for view, piece in zip(full_views(full, dim, tp_rank, tp_size, glu), local_pieces(local, dim, glu)):
        view.copy_(piece)


def join_shards(shards: list[torch.Tensor], dim: int, glu: bool) -> torch.Tensor:
    """Full tensor from the shards of TP ranks 0..n-1."""
    if not glu:
        return torch.cat(shards, dim=dim)
    halves = [local_pieces(s, dim, True) for s in shards]
    return torch.cat([torch.cat([h[0] for h in halves], dim=dim), torch.cat([h[1] for h in halves], dim=dim)], dim=dim)


# Replicated parameters of a 3D layer (model/tp3d.py): the norms hold the x block of the full hidden
# features; a linear's bias holds its output block (over y for a normal linear, over x for a
# transposed one). Both are replicated over the other axes, their gradients partial over z.
GRID_NORMS = (".input_layernorm.weight", ".input_layernorm.bias", ".pre_mlp_layernorm.weight",
              ".pre_mlp_layernorm.bias")
GRID_BIASES = {suffix[:-len("weight")] + "bias": transposed for suffix, transposed in GRID_LINEARS.items()}


def grid_transposed(name: str) -> bool | None:
    """For a parameter of a 3D stage: whether its linear runs transposed, None when it is not one of
    the four distributed linear weights (norms and biases are replicated on every rank of the grid)."""
    for suffix, transposed in GRID_LINEARS.items():
        if name.endswith(suffix):
            return transposed
    return None


def grid_kind(name: str) -> str | None:
    """``"weight"`` (a distributed linear weight), ``"norm"`` (a layer norm's weight or bias),
    ``"bias"`` (a linear's bias) for a parameter inside a 3D layer, None for everything else (the
    embedding, final norm and output layer: megatron-core at TP = gy, whole on every x and z rank)."""
    if ".layers." not in name:
        return None
    if grid_transposed(name) is not None:
        return "weight"
    if name.endswith(GRID_NORMS):
        return "norm"
    if any(name.endswith(suffix) for suffix in GRID_BIASES):
        return "bias"
    return None


def _grid(grid: tuple[int, int, int]) -> Grid4D:
    return Grid4D(x=grid[0], y=grid[1], z=grid[2])


def _block(n: int, parts: int, i: int, name: str, axis: str) -> slice:
    if n % parts:
        raise ValueError(f"{name}: {n} features must be a multiple of the {axis} axis size {parts}. "
                         f"Fix: choose a grid whose {axis} divides {n}")
    return slice(i * n // parts, (i + 1) * n // parts)


def grid_index(name: str, full_shape: tuple[int, ...], grid: tuple[int, int, int], rank: int,
               gated: bool) -> tuple[slice, ...] | None:
    """Pure: the index into the full tensor ``name`` of shape ``full_shape`` that rank ``rank`` (grid
    order, x fastest) of a 3D stage holds: its z shard of the (y, x) block for the four linear weights
    (tp/linear3d.weight_block), the x block for a layer norm, the output block for a linear's bias;
    None (the whole tensor) for everything outside the 3D layers."""
    kind = grid_kind(name)
    if kind is None:
        return None
    if is_glu(name, gated):
        raise ValueError(f"{name}: the gated MLP's fused [gate; up] weight has no 3D layout yet. "
                         f"Fix: use 1D tensor parallelism (no tp_grid) for gated (SwiGLU) models")
    g = _grid(grid)
    c = g.coords(rank)
    if kind == "weight":
        return weight_block(full_shape[1], full_shape[0], g, c, transpose=grid_transposed(name))["weight"]
    if kind == "norm":
        return (_block(full_shape[0], g.x, c["x"], name, "x"),)
    axis = "x" if GRID_BIASES[next(s for s in GRID_BIASES if name.endswith(s))] else "y"
    return (_block(full_shape[0], getattr(g, axis), c[axis], name, axis),)


def grid_full_shape(name: str, local_shape: tuple[int, ...], grid: tuple[int, int, int],
                    partition_dim: int | None) -> tuple[int, ...]:
    """Pure: the full (global) shape of the parameter ``name`` whose local shape on a rank of a 3D
    stage with grid ``(gx, gy, gz)`` is ``local_shape``."""
    gx, gy, gz = grid
    kind = grid_kind(name)
    shape = list(local_shape)
    if kind == "weight":
        g_in, g_out = (gy, gx) if grid_transposed(name) else (gx, gy)
        return (shape[0] * g_out * gz, shape[1] * g_in)
    if kind == "norm":
        return (shape[0] * gx,)
    if kind == "bias":
        transposed = next(t for s, t in GRID_BIASES.items() if name.endswith(s))
        return (shape[0] * (gx if transposed else gy),)
    if partition_dim is not None:
        shape[partition_dim] *= gy
    return tuple(shape)


def grid_rank_offsets(name: str, grid: tuple[int, int, int], rank: int,
                      partition_dim: int | None) -> tuple[tuple[int, int, int], ...]:
    """Pure: rank ``rank``'s block of ``name`` on a 3D stage as megatron-core dist-checkpointing rank
    offsets, ``(axis, fragment index, fragments)`` per split axis (the same block as ``grid_index``):
    a linear weight's rows are the z shard of the output block (``g_out * gz`` fragments), its columns
    the input block; a norm the x block; a bias the output block; outside the 3D layers megatron-core's
    TP = gy split (over y along ``partition_dim``)."""
    kind = grid_kind(name)
    g = _grid(grid)
    c = g.coords(rank)
    if kind == "weight":
        in_axis, out_axis = ("y", "x") if grid_transposed(name) else ("x", "y")
        return ((0, c[out_axis] * g.z + c["z"], getattr(g, out_axis) * g.z), (1, c[in_axis], getattr(g, in_axis)))
    if kind == "norm":
        return ((0, c["x"], g.x),)
    if kind == "bias":
        axis = "x" if GRID_BIASES[next(s for s in GRID_BIASES if name.endswith(s))] else "y"
        return ((0, c[axis], getattr(g, axis)),)
    return () if partition_dim is None else ((partition_dim, c["y"], g.y),)


def grid_contributes(name: str, grid: tuple[int, int, int], rank: int) -> bool:
    """Pure: whether rank ``rank``'s gradient of ``name`` goes into a sum over holders, so that the
    sum of contributions is the full gradient exactly once. Linear weights: every rank (disjoint
    blocks, already reduce-scattered over z); norms: the y = 0 ranks, every z (each z rank's gradient
    covers its batch rows); biases: the input-axis coordinate 0 (x for a normal linear, y for a
    transposed one), every z; outside the 3D layers: x = z = 0 (the x and z copies are identical)."""
    kind = grid_kind(name)
    c = _grid(grid).coords(rank)
    if kind == "weight":
        return True
    if kind == "norm":
        return c["y"] == 0
    if kind == "bias":
        transposed = GRID_BIASES[next(s for s in GRID_BIASES if name.endswith(s))]
        return c["y" if transposed else "x"] == 0
    return c["x"] == 0 and c["z"] == 0


def grid_view(full: torch.Tensor, name: str, grid: tuple[int, int, int], rank: int, gated: bool) -> torch.Tensor:
    """The view of the full (global, plan-independent) tensor ``name`` that rank ``rank`` of a 3D stage
    holds (``grid_index``); the whole tensor outside the 3D layers."""
    index = grid_index(name, tuple(full.shape), grid, rank, gated)
    return full if index is None else full[index]


def write_grid_local(full: torch.Tensor, local: torch.Tensor, name: str, grid: tuple[int, int, int], rank: int,
                     gated: bool) -> None:
    """Write rank ``rank``'s local tensor of a 3D stage into its place in ``full``."""
    grid_view(full, name, grid, rank, gated).copy_(local)
