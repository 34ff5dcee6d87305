"""Core attention through torch's ``scaled_dot_product_attention`` where transformer-engine is absent.

megatron-core's local spec computes attention as ``DotProductAttention``: it materialises the
[b, heads, s, s] scores (and their softmax) per layer, which on a 4k-token Llama-2-7B stage is tens
of GiB more than the planner prices (``perf/predict.py`` prices fused attention on GPUs). Every AMD
node and every GPU node without transformer-engine ran that path. ``SdpaAttention`` keeps
``DotProductAttention``'s construction (heads per partition, softmax scale, dropout) and replaces its
forward with one ``F.scaled_dot_product_attention`` call, which dispatches to the flash or
memory-efficient kernels on CUDA and ROCm (and to the math kernel on the host). Features SDPA has
no argument for (sliding windows, softmax offsets, query-key layer scaling) fall back to the
unfused forward, named in a warning once.
"""

from __future__ import annotations

import contextlib
import logging

import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

__all__ = ["SdpaAttention"]

log = logging.getLogger(__name__)


class SdpaAttention(DotProductAttention):
    """``DotProductAttention`` with a fused forward: same inputs ([s, b, heads, head dim] query, key,
    value; a boolean mask whose True entries are masked out, or None with a causal mask type), same
    output ([s, b, heads x head dim])."""

    def _unsupported(self) -> str | None:
        if self.softmax_offset is not None:
            return f"softmax_type {self.config.softmax_type!r}"
        if self.config.apply_query_key_layer_scaling:
            return "apply_query_key_layer_scaling"
        if self.config.window_size is not None:
            return "window_size (sliding-window attention)"
        return None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        unsupported = self._unsupported()
        if unsupported is not None or packed_seq_params is not None or attention_bias is not None:
            if not getattr(self, "_warned", False):
                log.warning("attention: %s needs megatron-core's unfused attention (s x s scores held)",
                            unsupported or "packed sequences / attention bias")
                self._warned = True
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:  # grouped-query attention: each key/value head serves ``groups`` query heads
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, head dim]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = attention_mask is None and mask_type == AttnMaskType.causal and sq > 1
        mask = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        p = self.attention_dropout.p if self.training else 0.0
        # dropout draws from the TP-consistent RNG stream, as the parent does
        rng = (tensor_parallel.get_cuda_rng_tracker().fork() if p > 0 and not self.config.sequence_parallel
               else contextlib.nullcontext())
        with rng:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal,
                                                     scale=self.softmax_scale)
        # [b, heads, s, head dim] -> [s, b, heads x head dim]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def with_sdpa(spec):
    """A copy of a local layer spec (ModuleSpec or block submodules) whose core attention is SDPA."""
    from megatron_het.tp.spec import swap_module_class

    return swap_module_class(spec, DotProductAttention, SdpaAttention)
