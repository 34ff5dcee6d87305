"""The cells of the holders' consistency check (runtime/consistency.py), without processes: every
holder's piece is a union of whole cells, and each cell sits where the holder's local tensor has it."""

import torch

from megatron_het.checkpoint.tp_layout import slice_full
from megatron_het.runtime.consistency import _local_cells, cell_grid
from megatron_het.runtime.grad_sync import Holding, held_indices


def _h(rank, tp_rank, tp_size, dim, shape, *, stage=(0, 0), glu=False):
    return Holding(name="w", rank=rank, stage_key=stage, tp_rank=tp_rank, tp_size=tp_size, partition_dim=dim,
                   full_shape=shape, glu=glu)


def test_tp2_beside_tp4_cuts_at_the_finer_shards():
    shape = (8, 3)
    holders = [_h(0, 0, 2, 0, shape), _h(1, 1, 2, 0, shape)] + [_h(2 + r, r, 4, 0, shape, stage=(1, 0)) for r in range(4)]
    cells = cell_grid(holders)
    assert cells == [((0, 2), (0, 3)), ((2, 4), (0, 3)), ((4, 6), (0, 3)), ((6, 8), (0, 3))]
    assert [c for c, _ in _local_cells(holders[1], cells)] == cells[2:]  # TP rank 1 of 2 holds rows 4..7
    assert [c for c, _ in _local_cells(holders[3], cells)] == [cells[1]]


def test_a_replicated_copy_on_every_tp_rank_is_one_cell_each_holder_holds():
    shape = (5,)
    holders = [_h(r, r, 2, None, shape) for r in range(2)]
    cells = cell_grid(holders)
    assert cells == [((0, 5),)]
    assert all(len(_local_cells(h, cells)) == 1 for h in holders)


def test_gated_fc1_pieces_map_back_to_the_local_gate_and_up_halves():
    shape = (8, 2)  # [gate; up], each 4 rows; TP 2 rank 1 holds gate rows 2-3 and up rows 6-7
    full = torch.arange(16.0).view(shape)
    h = _h(1, 1, 2, 0, shape, glu=True)
    assert [list(i) for i in held_indices(h)] == [[2, 3, 6, 7], [0, 1]]
    one = _h(0, 0, 1, 0, shape, stage=(1, 0), glu=True)
    cells = cell_grid([h, _h(0, 0, 2, 0, shape, glu=True), one])
    local = slice_full(full, 0, 1, 2, True)
    for (rows, _), where in _local_cells(h, cells):
        assert torch.equal(local[where], full[rows[0]:rows[1]])
    assert len(_local_cells(one, cells)) == len(cells)  # the TP 1 holder holds every cell
