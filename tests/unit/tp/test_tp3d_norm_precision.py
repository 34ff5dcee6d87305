"""The 3D layers' LayerNorm (model/tp3d.XSplitLayerNorm) takes its statistics in fp32.

In bf16, E[x^2] - mean^2 cancels: for hidden states whose mean is 16 standard deviations (a trained
model's residual stream drifts like this; a fresh one stays near 0, so the parity tests never saw it)
the bf16 variance came out 0, 2 or -4 where the true one is ~1, i.e. rsqrt blow-ups or NaN. Checked
against torch's own LayerNorm in float64, on a one-rank x axis."""

from __future__ import annotations

import types

import torch

from megatron_het.model.tp3d import XSplitLayerNorm

from support.one_rank import one_rank_world


def test_bf16_statistics_match_a_float64_layer_norm():
    torch.manual_seed(0)
    x = (16.0 + torch.randn(4, 3, 256, dtype=torch.float64)).to(torch.bfloat16)
    with one_rank_world():
        import torch.distributed as dist

        groups = types.SimpleNamespace(grid=types.SimpleNamespace(x=1), x=dist.group.WORLD)
        norm = XSplitLayerNorm(types.SimpleNamespace(normalization="LayerNorm", params_dtype=torch.bfloat16),
                               hidden_size=256, eps=1e-5, grid_groups=groups)
        got = norm(x)
    ref = torch.nn.functional.layer_norm(x.double(), (256,), eps=1e-5)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    # one bf16 rounding of values of size ~3: |error| <= 2^-8 * 4 = 0.016
    assert (got.double() - ref).abs().max() <= 0.016
