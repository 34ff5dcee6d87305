"""Where a 3D tensor-parallel rank's weights sit in the global (plan-independent) tensors: every
element is held by exactly one rank, and it is what Linear3D itself takes from the full weight."""

import pytest
import torch

from megatron_het.checkpoint.tp_layout import grid_transposed, grid_view, write_grid_local
from megatron_het.tp import Grid4D, GridGroups, Linear3D

GRIDS = [(2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4), (4, 1, 1), (1, 4, 1), (2, 2, 2)]
NAMES = {  # name -> full [out, in] shape of a layer with h=8, ffn=16, 4 heads (qkv width 24)
    "decoder.layers.0.self_attention.linear_qkv.weight": (24, 8),
    "decoder.layers.0.self_attention.linear_proj.weight": (8, 8),
    "decoder.layers.1.mlp.linear_fc1.weight": (16, 8),
    "decoder.layers.1.mlp.linear_fc2.weight": (8, 16),
}


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("name", list(NAMES))
def test_every_element_is_held_by_exactly_one_rank(grid, name):
    full = torch.randn(*NAMES[name], dtype=torch.float64)
    rebuilt, count = torch.zeros_like(full), torch.zeros_like(full)
    ranks = grid[0] * grid[1] * grid[2]
    for r in range(ranks):
        local = grid_view(full, name, grid, r, gated=False).clone()
        write_grid_local(rebuilt, local, name, grid, r, gated=False)
        grid_view(count, name, grid, r, gated=False).add_(1)
    assert torch.equal(rebuilt, full) and torch.equal(count, torch.ones_like(full))


@pytest.mark.parametrize("grid", GRIDS)
def test_grid_view_is_what_linear3d_holds(grid):
    g = Grid4D(x=grid[0], y=grid[1], z=grid[2])
    for name, (out, inp) in NAMES.items():
        full = torch.randn(out, inp, dtype=torch.float64)
        for r in range(g.size):
            groups = GridGroups(grid=g, coords=g.coords(r), x=None, y=None, z=None, data=None)
            layer = Linear3D(inp, out, groups=groups, transpose=grid_transposed(name), full_weight=full,
                             dtype=torch.float64)
            assert torch.equal(layer.weight.detach(), grid_view(full, name, grid, r, gated=False)), (name, r)


def test_replicated_parameters_and_gated_refusal():
    norm = torch.randn(8)
    assert grid_view(norm, "decoder.layers.0.input_layernorm.weight", (2, 2, 1), 3, gated=False) is norm
    assert grid_transposed("decoder.layers.0.mlp.linear_fc1.bias") is None
    with pytest.raises(ValueError, match=r"gated MLP's fused \[gate; up\] weight has no 3D layout yet"):
        grid_view(torch.randn(32, 8), "decoder.layers.0.mlp.linear_fc1.weight", (1, 2, 1), 0, gated=True)
