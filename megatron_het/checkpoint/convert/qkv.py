"""megatron-core's fused QKV <-> separate Q, K, V (pure tensor reshapes).

megatron-core stores ``linear_qkv`` rows per query group g: the group's query heads, then its one
key head, then its one value head ([q_g, k_g, v_g], each head ``kv_channels`` rows). Hugging Face
keeps Q (all heads), K and V apart (Llama) or concatenated as [Q; K; V] (GPT-2's c_attn).
The same reorder applies to the bias (a trailing dim of size 1 is added and removed).
"""

from __future__ import annotations

import torch

from megatron_het.cluster import ModelSpec


def split_qkv(fused: torch.Tensor, model: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(heads + 2*groups) * d, ...] interleaved -> (q [heads*d, ...], k [groups*d, ...], v [groups*d, ...])."""
    g, d = model.num_query_groups, model.kv_channels
    per_group = model.num_attention_heads // g
    rest = fused.shape[1:]
    grouped = fused.reshape(g, per_group + 2, d, *rest)
    q = grouped[:, :per_group].reshape(g * per_group * d, *rest)
    k = grouped[:, per_group].reshape(g * d, *rest)
    v = grouped[:, per_group + 1].reshape(g * d, *rest)
    return q.clone(), k.clone(), v.clone()


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelSpec) -> torch.Tensor:
    """Inverse of :func:`split_qkv`."""
    g, d = model.num_query_groups, model.kv_channels
    per_group = model.num_attention_heads // g
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(g, per_group, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)],
                        dim=1)
    return grouped.reshape(g * (per_group + 2) * d, *rest).clone()
