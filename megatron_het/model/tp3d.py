"""A megatron-core transformer layer whose linears are AxoNN's 3D-parallel ``Linear3D`` (#20).

Layout on a grid ``(gx, gy, gz)`` of a stage's ranks (tp/grid.Grid4D, x fastest): the hidden states
between and inside layers are ``[s, b/gz, h/gx]`` blocks — z splits the *batch* (core attention
needs whole sequences), x the hidden features — replicated over y. In each layer:

* ``input_layernorm`` / ``pre_mlp_layernorm``: ``XSplitLayerNorm``, the statistics all-reduced over
  x (its weight and bias are the x block of the full ones);
* ``linear_qkv`` (normal ``Linear3D``): ``[.., h/gx] -> [.., qkv/gy]``; core attention runs
  megatron-core's own code on ``heads/gy`` heads, so megatron-core is given the y group as its
  tensor-parallel group (``tensor_model_parallel_size = gy``);
* ``linear_proj`` (transposed): ``[.., h/gy] -> [.., h/gx]``; the residual add needs nothing;
* ``linear_fc1`` (normal) ``[.., h/gx] -> [.., ffn/gy]``, activation, ``linear_fc2`` (transposed)
  ``-> [.., h/gx]``.

Not for gated MLPs. The norms' parameters and the linears' biases are replicated over z (and over
y, resp. the linear's input-feature axis): each z rank's gradient covers only its batch rows, so
they are summed over z (``sum_replicated_grads_over_z``), as the runtime's gradient reduction
would do.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from megatron_het.tp.groups import GridGroups
from megatron_het.tp.linear3d import Linear3D

__all__ = ["GridLinear", "XSplitLayerNorm", "grid_layer_spec", "sum_replicated_grads_over_z"]


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group; the gradient of a sum whose every output is used is the sum of gradients."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        t = t.clone()
        if dist.get_world_size(group=group) > 1:
            dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.contiguous().clone()
        if dist.get_world_size(group=ctx.group) > 1:
            dist.all_reduce(g, group=ctx.group)
        return g, None


class XSplitLayerNorm(torch.nn.Module):
    """LayerNorm over a hidden dim split over x: mean and variance from x-summed partial sums."""

    def __init__(self, config: Any = None, hidden_size: int = 0, eps: float = 1e-5, *, grid_groups: GridGroups,
                 **_unused: Any) -> None:
        super().__init__()
        gx = grid_groups.grid.x
        if hidden_size % gx:
            raise ValueError(f"hidden_size: {hidden_size} must be a multiple of the x axis size {gx}. "
                             f"Fix: choose a grid whose x divides the hidden size")
        if config is not None and getattr(config, "normalization", "LayerNorm") != "LayerNorm":
            raise ValueError(f"config.normalization: {config.normalization!r} has no 3D layer yet. "
                             f"Fix: use LayerNorm, or 1D tensor parallelism")
        dtype = getattr(config, "params_dtype", torch.float32) if config is not None else torch.float32
        self.hidden_size, self.eps, self.groups = hidden_size, eps, grid_groups
        self.weight = torch.nn.Parameter(torch.ones(hidden_size // gx, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size // gx, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in fp32, as megatron-core's norms: in bf16 E[x^2] - mean^2 cancels to 0 or below
        # as soon as |mean| is several standard deviations (NaN from rsqrt); one x all-reduce of both sums
        wide = torch.promote_types(x.dtype, torch.float32)  # fp32, or the run's own when wider (fp64 tests)
        xf = x.to(wide)
        stats = torch.stack([xf.sum(-1), (xf * xf).sum(-1)])
        stats = _AllReduceSum.apply(stats, self.groups.x) / self.hidden_size
        mean, sq = stats[0].unsqueeze(-1), stats[1].unsqueeze(-1)
        var = (sq - mean * mean).clamp(min=0.0)
        y = (xf - mean) * torch.rsqrt(var + self.eps) * self.weight.to(wide) + self.bias.to(wide)
        return y.to(x.dtype)


class GridLinear(torch.nn.Module):
    """megatron-core's linear-layer interface (``(output, bias)``) over ``Linear3D``.

    The full ``[output_size, input_size]`` weight is drawn with ``init_method`` on the host (the same
    values on every rank given the same seed, as megatron-core's CPU initialisation) and the rank
    keeps its block (tp/linear3d.weight_block). A bias is the output block's slice of the full bias
    (zeros at init, as megatron-core), replicated over the input-feature axis and z; with
    ``skip_bias_add`` it is returned for megatron-core to add (bias-dropout-add, bias-GeLU)."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Any, bias: bool,
                 grid_groups: GridGroups, transpose: bool, skip_bias_add: bool = False, chunks: int = 4,
                 overlap: bool = True, **_unused: Any) -> None:
        super().__init__()
        full = torch.empty(output_size, input_size, dtype=config.params_dtype)
        init_method(full)
        self.inner = Linear3D(input_size, output_size, groups=grid_groups, transpose=transpose, chunks=chunks,
                              overlap=overlap, full_weight=full, dtype=config.params_dtype)
        self.weight = self.inner.weight
        self.skip_bias_add = skip_bias_add
        out_block = self.inner.blocks["output_features"][0]
        self.bias = torch.nn.Parameter(torch.zeros(out_block.stop - out_block.start, dtype=config.params_dtype)) \
            if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        y = self.inner(x)
        if self.bias is None or self.skip_bias_add:
            return y, self.bias
        return y + self.bias, None


def grid_layer_spec(grid_groups: GridGroups, *, chunks: int = 4, overlap: bool = True):
    """megatron-core's local GPT layer spec with the four linears and both norms replaced."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="LayerNorm")
    sub = spec.submodules
    norm = functools.partial(XSplitLayerNorm, grid_groups=grid_groups)
    lin = functools.partial(GridLinear, grid_groups=grid_groups, chunks=chunks, overlap=overlap)
    sub.input_layernorm = norm
    sub.pre_mlp_layernorm = norm
    att = sub.self_attention.submodules
    att.linear_qkv = functools.partial(lin, transpose=False)
    att.linear_proj = functools.partial(lin, transpose=True)
    mlp = sub.mlp.keywords["submodules"] if isinstance(sub.mlp, functools.partial) else sub.mlp.submodules
    mlp.linear_fc1 = functools.partial(lin, transpose=False)
    mlp.linear_fc2 = functools.partial(lin, transpose=True)
    return spec


def sum_replicated_grads_over_z(module: torch.nn.Module, grid_groups: GridGroups) -> None:
    """Sum the gradient of every norm parameter and linear bias over z (each z rank saw its rows)."""
    if grid_groups.grid.z == 1:
        return
    for m in module.modules():
        params = list(m.parameters()) if isinstance(m, XSplitLayerNorm) else \
            [m.bias] if isinstance(m, GridLinear) and m.bias is not None else []
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=grid_groups.z)
