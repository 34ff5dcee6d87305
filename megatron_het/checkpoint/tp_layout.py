"""Where a rank's tensor-parallel shard sits inside the full tensor.

Most TP-partitioned tensors are plain chunks along ``partition_dim``. The first MLP projection of a
gated (SwiGLU) model is not: megatron-core stores ``linear_fc1`` as [gate; up] and gives TP rank r
[gate_r; up_r] (megatron's own checkpoints split it with ``apply_swiglu_sharded_factory``). Every
place that slices, joins or writes shards goes through these functions so both layouts stay right
for any pair of TP sizes.
"""

from __future__ import annotations

import torch

GLU_MARK = ".mlp.linear_fc1."


def is_glu(name: str, gated: bool) -> bool:
    """True for the fused gate/up projection of a gated MLP."""
    return gated and GLU_MARK in name


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
