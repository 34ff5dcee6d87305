"""AxoNN's 3D tensor-parallel linear layer: grid arithmetic (pure) and numerical equality with a
single-process linear layer (forward and all gradients) on 4 gloo ranks."""

import pytest

from megatron_het.tp import Grid4D, GridGroups, linear3d_blocks, rows_of

from workers.overlap_workers import GRIDS_3D, SHAPES_3D, VARIANTS_3D, pure_results


def test_grid_coords_and_groups():
    g = Grid4D(x=2, y=3, z=2, data=2)
    assert g.size == 24 and g.tensor_parallel == 12
    assert g.coords(0) == {"x": 0, "y": 0, "z": 0, "data": 0}
    assert g.coords(19) == {"x": 1, "y": 0, "z": 1, "data": 1}  # 19 = 1 + 2*(0 + 3*(1 + 2*1))
    assert g.coords(13) == {"x": 1, "y": 0, "z": 0, "data": 1}
    assert [g.stride(a) for a in ("x", "y", "z", "data")] == [1, 2, 6, 12]
    assert g.axis_group_of("y", 19) == (19, 21, 23)
    assert g.axis_group_of("z", 19) == (13, 19)
    assert g.axis_group_of("data", 19) == (7, 19)
    for axis in ("x", "y", "z", "data"):
        groups = g.axis_groups(axis)
        assert sorted(r for grp in groups for r in grp) == list(range(24))  # a partition
        assert len(groups) == 24 // getattr(g, axis)


def test_grid_validation_messages():
    with pytest.raises(ValueError, match=r"Grid4D.z: must be an int >= 1, got 0 \(limit 1\)"):
        Grid4D(x=1, y=1, z=0)
    with pytest.raises(ValueError, match=r"rank: must be in \[0, 4\), got 4 \(limit 3\)"):
        Grid4D(x=2, y=2, z=1).coords(4)


def _groups(grid, rank):
    return GridGroups(grid=grid, coords=grid.coords(rank), x=None, y=None, z=None, data=None)


def test_blocks_layout_and_transpose():
    grid = Grid4D(x=2, y=2, z=2)
    g = _groups(grid, 7)  # x=1, y=1, z=1
    b = linear3d_blocks(8, 16, g)
    # out block y=1 is rows 8..16, its z=1 shard rows 12..16; in block x=1 is cols 4..8
    assert b["weight"] == (slice(12, 16), slice(4, 8))
    assert b["input_features"] == (slice(4, 8),) and b["output_features"] == (slice(8, 16),)
    g5 = _groups(grid, 5)  # x=1, y=0, z=1
    bt = linear3d_blocks(8, 16, g5, transpose=True)  # in split over y (=0), out over x (=1)
    assert bt["input_features"] == (slice(0, 4),) and bt["output_features"] == (slice(8, 16),)
    assert rows_of(12, g) == slice(6, 12)


def test_blocks_validation_messages():
    g = _groups(Grid4D(x=2, y=2, z=2), 0)
    with pytest.raises(ValueError, match=r"in_features: 7 must be a multiple of the x axis size 2"):
        linear3d_blocks(7, 16, g)
    with pytest.raises(ValueError, match=r"out_features: 6 must be a multiple of y\*z = 2\*2 = 4"):
        linear3d_blocks(8, 6, g)
    with pytest.raises(ValueError, match=r"rows: 5 must be a multiple of the z axis size 2"):
        rows_of(5, g)


@pytest.mark.multiproc
@pytest.mark.parametrize("variant", VARIANTS_3D, ids=lambda v: f"chunks{v[0]}-{'overlap' if v[1] else 'blocking'}")
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("shape", SHAPES_3D)
@pytest.mark.parametrize("grid", GRIDS_3D)
def test_linear3d_equals_single_process(grid, shape, transpose, variant):
    """Chunked async (all three collectives overlapped), chunked blocking and plain: all equal the
    float64 single-process layer."""
    for rank, res in enumerate(pure_results()):
        errs = res["linear3d"][(grid, shape, transpose, *variant)]
        assert set(errs) == {"y", "dx", "dw"}
        for what, err in errs.items():
            assert err < 1e-12, f"rank {rank} grid {grid} shape {shape} transpose={transpose}: {what} off by {err}"


@pytest.mark.multiproc
@pytest.mark.parametrize("variant", VARIANTS_3D, ids=lambda v: f"chunks{v[0]}-{'overlap' if v[1] else 'blocking'}")
@pytest.mark.parametrize("grid", GRIDS_3D)
def test_linear3d_mlp_chain_needs_no_redistribution(grid, variant):
    for rank, res in enumerate(pure_results()):
        errs = res["linear3d"][("mlp", grid, *variant)]
        assert set(errs) == {"y", "dx", "dw1", "dw2"}
        assert max(errs.values()) < 1e-12, (rank, grid, errs)
