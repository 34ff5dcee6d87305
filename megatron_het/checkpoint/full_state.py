"""Plan-independent model state: full (unsharded) tensors named by *global* layer index.

A stage model holds a contiguous slice of layers, each tensor-parallel parameter split along its
``partition_dim`` (megatron-core marks them with ``tensor_model_parallel``/``partition_dim``).
Mapping a stage's local names to global ones and slicing/assembling TP shards is all that any two
plans need to exchange weights, so parity tests, resharding and format conversion share this code.

Names follow a single-stage GPTModel with megatron-core's local layer spec:
``embedding.word_embeddings.weight``, ``decoder.layers.<global i>.<...>``,
``decoder.final_layernorm.*``, ``output_layer.weight``. With tied embeddings the full state has no
``output_layer.weight``: the last stage's output layer reads ``embedding.word_embeddings.weight``.
A stage built with the transformer-engine spec (``--transformer-impl transformer_engine``) fuses each
layer norm into the linear layer after it (``self_attention.linear_qkv.layer_norm_weight``,
``mlp.linear_fc1.layer_norm_weight``); ``global_name`` maps those to the local spec's names, so
checkpoints, resharding and parity do not depend on which spec a stage was built with (the same
correspondence megatron-core's ``sharded_state_dict_keys_map`` states in ``gpt_layer_specs.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatron_het.checkpoint.tp_layout import grid_full_shape, grid_index, grid_view, is_glu, join_shards, slice_full

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..+)$")
# transformer-engine spec's fused layer-norm parameters -> the local spec's layer norms
_TE_LAYER_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
TIED_OUTPUT = "output_layer.weight"
WORD_EMBEDDING = "embedding.word_embeddings.weight"


def global_name(local_name: str, layer_offset: int, first_expert: int = 0) -> str:
    """``decoder.layers.<i>.x`` of a stage whose first layer is global ``layer_offset`` -> global
    (transformer-engine's fused layer-norm names -> the local spec's). A routed expert megatron-core
    numbers locally (``mlp.experts.local_experts.<j>``) is named by its global index, ``first_expert + j``
    (``plan/experts.ExpertLayout.first_expert``: the rank's share under expert parallelism)."""
    m = _LAYER.match(local_name)
    if m is None:
        return local_name
    rest = _TE_LAYER_NORMS.get(m.group(2), m.group(2))
    if first_expert:
        e = _LOCAL_EXPERT.match(rest)
        if e is not None:
            rest = f"{e.group(1)}{int(e.group(2)) + first_expert}{e.group(3)}"
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{rest}"


def _tp_of(gname: str, tp_rank: int, tp_size: int, experts) -> tuple[int, int]:
    """(rank, size) of a parameter's tensor-parallel split: expert-TP for a routed expert's under
    ``experts`` (plan/experts.ExpertLayout), the stage's TP otherwise."""
    return (tp_rank, tp_size) if experts is None else experts.tp_coordinates(gname, tp_rank, tp_size)


def _partition_dim(param: torch.Tensor) -> int | None:
    if getattr(param, "tensor_model_parallel", False):
        return int(param.partition_dim)
    return None


def _source_name(name: str, full: Mapping[str, torch.Tensor], tied: bool) -> str:
    if name == TIED_OUTPUT and tied and TIED_OUTPUT not in full:
        return WORD_EMBEDDING
    return name


@dataclass(frozen=True, kw_only=True)
class Shard:
    """One rank's piece of a full tensor."""

    tensor: torch.Tensor  # the local values (CPU, detached)
    partition_dim: int | None  # dim split across TP ranks, None if replicated
    tp_rank: int
    tp_size: int
    glu: bool = False  # gated-MLP fc1: the shard is [gate_r; up_r] (see tp_layout.py)
    # a 3D layer's block (plan tp_grid, tp_layout.grid_index): the stage's (gx, gy, gz), ``tp_rank``
    # the rank's grid index, ``tp_size`` gx*gy*gz, ``full_shape`` the full tensor's shape
    grid: tuple[int, int, int] | None = None
    full_shape: tuple[int, ...] | None = None


def local_shards(model: torch.nn.Module, *, layer_offset: int, tp_rank: int, tp_size: int,
                 tied: bool, gated: bool = False, experts=None) -> dict[str, Shard]:
    """This stage's parameters as global-named shards (``output_layer.weight`` dropped if tied);
    ``experts``: the rank's ``plan/experts.ExpertLayout`` under expert parallelism (None: experts
    whole on every replica, split over the stage's TP)."""
    out: dict[str, Shard] = {}
    for name, param in model.named_parameters():
        gname = global_name(name, layer_offset, 0 if experts is None else experts.first_expert)
        if tied and gname == TIED_OUTPUT:
            continue  # a copy of the word embedding kept in sync by megatron's embedding group
        rank, size = _tp_of(gname, tp_rank, tp_size, experts)
        out[gname] = Shard(tensor=param.detach().cpu().clone(), partition_dim=_partition_dim(param),
                           tp_rank=rank, tp_size=size, glu=is_glu(gname, gated))
    return out


def assemble_full_state(shard_sets: list[Mapping[str, Shard]]) -> dict[str, torch.Tensor]:
    """Join the shards of every rank (any plan) into full tensors; replicated copies must agree."""
    pieces: dict[str, dict[int, Shard]] = {}
    for shards in shard_sets:
        for name, shard in shards.items():
            pieces.setdefault(name, {})[shard.tp_rank] = shard
    full: dict[str, torch.Tensor] = {}
    for name, by_rank in pieces.items():
        first = next(iter(by_rank.values()))
        if first.grid is not None:
            full[name] = _assemble_grid(name, first, by_rank)
            continue
        if first.partition_dim is None:
            full[name] = first.tensor
            continue
        missing = [r for r in range(first.tp_size) if r not in by_rank]
        if missing:
            raise ValueError(f"{name}: TP shards {missing} of {first.tp_size} are missing")
        full[name] = join_shards([by_rank[r].tensor for r in range(first.tp_size)], first.partition_dim, first.glu)
    return full


@torch.no_grad()
def load_full_state(model: torch.nn.Module, full: Mapping[str, torch.Tensor], *, layer_offset: int,
                    tp_rank: int, tp_size: int, tied: bool, gated: bool = False, experts=None) -> None:
    """Copy the matching slice of every full tensor into this stage's parameters (``experts``: as
    ``local_shards``)."""
    for name, param in model.named_parameters():
        gname = _source_name(global_name(name, layer_offset, 0 if experts is None else experts.first_expert),
                             full, tied)
        if gname not in full:
            raise KeyError(f"full state has no tensor {gname!r} for parameter {name!r}")
        src = full[gname]
        dim = _partition_dim(param)
        rank, size = _tp_of(gname, tp_rank, tp_size, experts)
        if dim is not None:
            if src.shape[dim] % size:
                raise ValueError(f"{gname}: dim {dim} of size {src.shape[dim]} is not divisible by TP={size}")
            src = slice_full(src, dim, rank, size, is_glu(gname, gated))
        if tuple(src.shape) != tuple(param.shape):
            raise ValueError(f"{gname}: full-state slice has shape {tuple(src.shape)}, "
                             f"parameter {name!r} has {tuple(param.shape)}")
        param.copy_(src.to(param.dtype))


def _assemble_grid(name: str, first: Shard, by_rank: Mapping[int, Shard]) -> torch.Tensor:
    """A 3D layer's tensor from every grid rank's block (replicated blocks must agree)."""
    missing = [r for r in range(first.tp_size) if r not in by_rank or by_rank[r].grid != first.grid]
    if missing:
        raise ValueError(f"{name}: 3D blocks of grid ranks {missing} of grid {list(first.grid)} are missing")
    out = torch.zeros(first.full_shape, dtype=first.tensor.dtype)
    for r in range(first.tp_size):
        grid_view(out, name, first.grid, r, first.glu).copy_(by_rank[r].tensor)
    return out


def _grid_y(grid: tuple[int, int, int], grid_rank: int) -> tuple[int, int, int]:
    """(x, y, z) coordinates of a grid rank (x fastest)."""
    gx, gy, _ = grid
    return grid_rank % gx, (grid_rank // gx) % gy, grid_rank // (gx * gy)


def local_grid_shards(model: torch.nn.Module, *, layer_offset: int, grid: tuple[int, int, int], grid_rank: int,
                      tied: bool) -> dict[str, Shard]:
    """``local_shards`` of a 3D stage (model/tp3d_stage.py): a 3D layer's parameters as grid blocks
    (full shape from the layout), everything else as megatron-core's TP = gy shards (tp_rank = y),
    reported by the x = z = 0 ranks only (the other x, z ranks hold copies)."""
    x, y, z = _grid_y(grid, grid_rank)
    out: dict[str, Shard] = {}
    for name, param in model.named_parameters():
        gname = global_name(name, layer_offset)
        if tied and gname == TIED_OUTPUT:
            continue
        t = param.detach().cpu().clone()
        dim = _partition_dim(param)
        if grid_index(gname, tuple(t.shape), grid, grid_rank, False) is not None or ".layers." in gname:
            shape = grid_full_shape(gname, tuple(t.shape), grid, None)
            out[gname] = Shard(tensor=t, partition_dim=None, tp_rank=grid_rank, tp_size=grid[0] * grid[1] * grid[2],
                               grid=tuple(grid), full_shape=shape)
        elif x == 0 and z == 0:
            out[gname] = Shard(tensor=t, partition_dim=dim, tp_rank=y, tp_size=grid[1])
    return out


@torch.no_grad()
def load_grid_full_state(model: torch.nn.Module, full: Mapping[str, torch.Tensor], *, layer_offset: int,
                         grid: tuple[int, int, int], grid_rank: int, tied: bool) -> None:
    """``load_full_state`` of a 3D stage: each 3D layer parameter gets its grid block, the rest its
    TP = gy slice (y coordinate)."""
    _, y, _ = _grid_y(grid, grid_rank)
    for name, param in model.named_parameters():
        gname = _source_name(global_name(name, layer_offset), full, tied)
        if gname not in full:
            raise KeyError(f"full state has no tensor {gname!r} for parameter {name!r}")
        src = full[gname]
        index = grid_index(gname, tuple(src.shape), grid, grid_rank, False)
        if index is not None:
            src = src[index]
        elif _partition_dim(param) is not None:
            src = slice_full(src, _partition_dim(param), y, grid[1], False)
        if tuple(src.shape) != tuple(param.shape):
            raise ValueError(f"{gname}: full-state block has shape {tuple(src.shape)}, "
                             f"parameter {name!r} has {tuple(param.shape)} (grid {list(grid)}, rank {grid_rank})")
        param.copy_(src.to(param.dtype))
