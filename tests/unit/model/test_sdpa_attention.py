"""SDPA core attention equals megatron-core's unfused DotProductAttention (issue #36, item 3).

Without transformer-engine (every AMD node, a bare `make env` on NVIDIA) the local spec's attention
materialised s x s scores while the planner priced fused attention; on GPUs the local spec now runs
``SdpaAttention``. Here, on the host's math kernel in float64, its outputs and input gradients
equal DotProductAttention's (the independent reference: megatron-core's own module) for a causal
mask type without a mask, an explicit padding-style mask, and grouped-query attention; and the GPU
layer spec swaps in SDPA while the host spec keeps the unfused module.
"""

from __future__ import annotations

import pytest
import torch

from megatron_het.cluster import ModelSpec
from megatron_het.model.gpt import layer_spec
from megatron_het.model.sdpa_attention import SdpaAttention

from support.one_rank import one_rank_world

TOL = 1e-12  # float64: the two differ only in summation order


def _modules(num_query_groups: int):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_het.platform import enable_cpu_backend

    enable_cpu_backend()  # megatron-core's host path (its memory buffer on the host)
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # megatron-core's one global (set once per process)
        parallel_state._set_global_memory_buffer()
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)  # dropout's stream
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=num_query_groups,
                               kv_channels=8, attention_dropout=0.0, hidden_dropout=0.0, params_dtype=torch.float64,
                               attention_softmax_in_fp32=False, masked_softmax_fusion=False)
    pgs = ProcessGroupCollection(tp=dist.group.WORLD)
    kw = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
              pg_collection=pgs)
    return DotProductAttention(**kw), SdpaAttention(**kw)


def _inputs(groups: int, s: int = 7, b: int = 2):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(s, b, groups, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(s, b, groups, 8, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("groups", [4, 2])
@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_equals_the_unfused_attention(groups, masked):
    with one_rank_world():
        unfused, fused = _modules(groups)
        s = 7
        mask = None
        if masked:  # megatron's convention: True = masked out (causal plus a padded last key)
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
            mask[:, -1] = True
            mask[-1, -1] = False
            mask = mask.view(1, 1, s, s)
        outs, grads = [], []
        for module in (unfused, fused):
            q, k, v = _inputs(groups, s)
            out = module(q, k, v, mask)
            out.backward(torch.cos(torch.arange(out.numel(), dtype=torch.float64)).view_as(out))
            outs.append(out.detach())
            grads.append([t.grad for t in (q, k, v)])
    assert outs[0].shape == outs[1].shape == (s, 2, 32)
    assert (outs[0] - outs[1]).abs().max() < TOL
    for a, b in zip(*grads):
        assert (a - b).abs().max() < TOL


def test_the_gpu_spec_runs_sdpa_and_the_host_spec_the_unfused_module():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    model = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64)

    def core(spec):
        return spec.submodules.self_attention.submodules.core_attention

    assert core(layer_spec(model, fused_attention=True)) is SdpaAttention
    assert core(layer_spec(model, fused_attention=False)) is DotProductAttention
    assert core(layer_spec(model)) is DotProductAttention  # this host has no GPU
    sp = layer_spec(model, sequence_parallel=True, num_layers=2, fused_attention=True)
    assert all(core(layer) is SdpaAttention for layer in sp.layer_specs)
