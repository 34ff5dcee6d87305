"""Where a 3D tensor-parallel rank's weights sit in the global (plan-independent) tensors: every
element is held by exactly one rank, and it is what Linear3D itself takes from the full weight."""

import pytest
import torch

from megatron_het.checkpoint.tp_layout import (
    grid_contributes,
    grid_index,
    grid_kind,
    grid_rank_offsets,
    grid_transposed,
    grid_view,
    write_grid_local,
)
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
    emb = torch.randn(64, 8)
    assert grid_view(emb, "embedding.word_embeddings.weight", (2, 2, 1), 3, gated=False) is emb
    final = torch.randn(8)
    assert grid_view(final, "decoder.final_layernorm.weight", (2, 2, 1), 3, gated=False) is final
    assert grid_transposed("decoder.layers.0.mlp.linear_fc1.bias") is None
    with pytest.raises(ValueError, match=r"gated MLP's fused \[gate; up\] weight has no 3D layout yet"):
        grid_view(torch.randn(32, 8), "decoder.layers.0.mlp.linear_fc1.weight", (1, 2, 1), 0, gated=True)


REPLICATED = {  # name -> (full length, axis of its block for a normal / transposed owner)
    "decoder.layers.0.input_layernorm.weight": (8, "x"),
    "decoder.layers.0.input_layernorm.bias": (8, "x"),
    "decoder.layers.2.pre_mlp_layernorm.weight": (8, "x"),
    "decoder.layers.0.self_attention.linear_qkv.bias": (24, "y"),
    "decoder.layers.0.self_attention.linear_proj.bias": (8, "x"),
    "decoder.layers.1.mlp.linear_fc1.bias": (16, "y"),
    "decoder.layers.1.mlp.linear_fc2.bias": (8, "x"),
}


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("name", list(REPLICATED))
def test_norms_and_biases_contributions_sum_to_z_copies(grid, name):
    """The contributing ranks' blocks cover every element once per z coordinate (each z rank's
    gradient is its batch rows' part), the block is the feature axis' chunk, and the non-contributing
    ranks hold exact copies of a contributor's block."""
    n, axis = REPLICATED[name]
    g = Grid4D(x=grid[0], y=grid[1], z=grid[2])
    count = torch.zeros(n)
    for r in range(g.size):
        c = g.coords(r)
        (sl,) = grid_index(name, (n,), grid, r, gated=False)
        size = getattr(g, axis)
        assert sl == slice(c[axis] * n // size, (c[axis] + 1) * n // size), (name, r, sl)
        if grid_contributes(name, grid, r):
            count[sl] += 1
    assert torch.equal(count, torch.full((n,), float(g.z))), (name, grid, count)


@pytest.mark.parametrize("grid", GRIDS)
def test_linear_bias_block_is_linear3d_output_block(grid):
    g = Grid4D(x=grid[0], y=grid[1], z=grid[2])
    for name, (out, inp) in NAMES.items():
        bias = name[:-len("weight")] + "bias"
        for r in range(g.size):
            groups = GridGroups(grid=g, coords=g.coords(r), x=None, y=None, z=None, data=None)
            layer = Linear3D(inp, out, groups=groups, transpose=grid_transposed(name), dtype=torch.float64)
            assert grid_index(bias, (out,), grid, r, gated=False) == layer.blocks["output_features"]


def test_weights_every_rank_contributes_outside_layers_one_copy():
    grid = (2, 2, 2)
    g = Grid4D(x=2, y=2, z=2)
    for name in NAMES:
        assert grid_kind(name) == "weight"
        assert all(grid_contributes(name, grid, r) for r in range(g.size))
    for name in ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.bias"):
        assert grid_kind(name) is None and grid_index(name, (8,), grid, 5, gated=False) is None
        contributors = [r for r in range(g.size) if grid_contributes(name, grid, r)]
        assert contributors == [r for r in range(g.size) if g.coords(r)["x"] == g.coords(r)["z"] == 0]
    with pytest.raises(ValueError, match=r"input_layernorm.weight: 6 features must be a multiple of the x axis "
                                         r"size 4"):
        grid_index("decoder.layers.0.input_layernorm.weight", (6,), (4, 1, 1), 0, gated=False)


@pytest.mark.parametrize("grid", GRIDS)
def test_dist_checkpoint_offsets_are_the_grid_blocks(grid):
    """The (axis, fragment, fragments) offsets a 3D rank saves under name the same block as grid_index."""
    g = Grid4D(x=grid[0], y=grid[1], z=grid[2])
    shapes = {**NAMES, **{n: (length,) for n, (length, _) in REPLICATED.items()}}
    for name, shape in shapes.items():
        for r in range(g.size):
            index = grid_index(name, shape, grid, r, gated=False)
            offsets = grid_rank_offsets(name, grid, r, None)
            split = {axis for axis, _, _ in offsets}
            assert all(index[d] == slice(0, shape[d]) for d in range(len(shape)) if d not in split), (name, r)
            for axis, frag, frags in offsets:
                size = shape[axis] // frags
                assert index[axis] == slice(frag * size, (frag + 1) * size), (name, r, axis)
    assert grid_rank_offsets("embedding.word_embeddings.weight", grid, g.size - 1, 0) == \
        ((0, g.coords(g.size - 1)["y"], g.y),)
    assert grid_rank_offsets("decoder.final_layernorm.weight", grid, 0, None) == ()
