"""Rank functions for the 3D tensor-parallel transformer-layer test (module-level for spawn; no tests)."""

from __future__ import annotations

import torch
import torch.distributed as dist

H, HEADS, FFN, SEQ, BATCH = 16, 4, 32, 8, 4
GRIDS = ((2, 2, 1), (1, 2, 2), (2, 1, 2), (1, 4, 1), (1, 1, 4))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _config(tp: int, bias: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                             add_bias_linear=bias, tensor_model_parallel_size=tp, params_dtype=torch.float64,
                             pipeline_dtype=torch.float64, use_cpu_initialization=True, hidden_dropout=0.0,
                             attention_dropout=0.0)


def layer_cases(rank: int, world: int) -> dict:
    return {bias: _layer_cases(rank, world, bias) for bias in (False, True)}


def _layer_cases(rank: int, world: int, bias: bool) -> dict:
    from megatron_het.platform import enable_cpu_backend

    enable_cpu_backend()
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from megatron_het.model.groups import ensure_global_memory_buffer
    from megatron_het.model.tp3d import grid_layer_spec, sum_replicated_grads_over_z
    from megatron_het.tp import Grid4D, create_grid_groups, weight_block

    ensure_global_memory_buffer()
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    me = singles[rank]
    model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(11)
    ref = build_module(get_gpt_layer_local_spec(normalization="LayerNorm"), config=_config(1, bias), layer_number=1,
                       pg_collection=ProcessGroupCollection(tp=me, cp=me, pp=me)).double()  # torch norms: fp32
    with torch.no_grad():  # non-trivial norm parameters and biases
        for n, p in ref.named_parameters():
            if "layernorm" in n or n.endswith(".bias"):
                p.copy_(torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(len(n))))
    g = torch.Generator().manual_seed(21)
    x = torch.randn(SEQ, BATCH, H, dtype=torch.float64, generator=g)
    dy = torch.randn(SEQ, BATCH, H, dtype=torch.float64, generator=g)
    xr = x.clone().requires_grad_(True)
    out_ref, _ = ref(xr)
    (out_ref * dy).sum().backward()
    full = dict(ref.named_parameters())
    out = {}
    for gx, gy, gz in GRIDS:
        grid = Grid4D(x=gx, y=gy, z=gz)
        groups = create_grid_groups(grid)
        c = groups.coords
        lay = build_module(grid_layer_spec(groups), config=_config(gy, bias), layer_number=1,
                           pg_collection=ProcessGroupCollection(tp=groups.y, cp=me, pp=me))
        xs = slice(c["x"] * H // gx, (c["x"] + 1) * H // gx)
        bs = slice(c["z"] * BATCH // gz, (c["z"] + 1) * BATCH // gz)
        views = {}
        for name, p in lay.named_parameters():
            ref_name = name.replace(".inner.", ".")
            f = full[ref_name]
            transposed = ref_name.startswith(("self_attention.linear_proj.", "mlp.linear_fc2."))
            if "layernorm" in name:
                views[name] = (f, (xs,))
            elif name.endswith(".bias"):  # the output block: over y (normal), x (transposed)
                n_out = f.shape[0] // (gx if transposed else gy)
                o = c["x"] if transposed else c["y"]
                views[name] = (f, (slice(o * n_out, (o + 1) * n_out),))
            else:
                blk = weight_block(f.shape[1], f.shape[0], grid, c, transpose=transposed)["weight"]
                views[name] = (f, blk)
            with torch.no_grad():
                p.copy_(views[name][0][views[name][1]])
        xi = x[:, bs, xs].clone().requires_grad_(True)
        y, _ = lay(xi)
        (y * dy[:, bs, xs]).sum().backward()
        sum_replicated_grads_over_z(lay, groups)
        errs = {"y": _err(y.detach(), out_ref.detach()[:, bs, xs]), "dx": _err(xi.grad, xr.grad[:, bs, xs])}
        for name, p in lay.named_parameters():
            f, sl = views[name]
            errs[name] = _err(p.grad, f.grad[sl])
        out[(gx, gy, gz)] = errs
    return out
