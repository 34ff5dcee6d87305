"""TP shard layout: plain chunks, and the gated-MLP [gate_r; up_r] layout, for any pair of TP sizes."""

from __future__ import annotations

import pytest
import torch

from megatron_het.checkpoint.tp_layout import is_glu, join_shards, slice_full, write_local


def glu_shard(full, tp, r):
    """How megatron-core lays out linear_fc1 of a gated MLP on TP rank r (independent reference)."""
    gate, up = full[: full.shape[0] // 2], full[full.shape[0] // 2:]
    g, u = gate.shape[0] // tp, up.shape[0] // tp
    return torch.cat([gate[r * g:(r + 1) * g], up[r * u:(r + 1) * u]])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_glu_slices_match_megatron_layout_and_join_back(tp):
    full = torch.arange(16 * 3, dtype=torch.float).view(16, 3)
    shards = [slice_full(full, 0, r, tp, glu=True) for r in range(tp)]
    for r in range(tp):
        assert torch.equal(shards[r], glu_shard(full, tp, r))
    assert torch.equal(join_shards(shards, 0, glu=True), full)
    # reshard 2 -> 4 goes through the full tensor without mixing gate and up rows
    assert torch.equal(join_shards([slice_full(full, 0, r, 4, True) for r in range(4)], 0, True), full)


def test_plain_chunks_and_in_place_writes():
    full = torch.arange(12, dtype=torch.float).view(4, 3)
    assert torch.equal(join_shards([slice_full(full, 1, r, 3, False) for r in range(3)], 1, False), full)
    buf = torch.zeros(16, 3)
    src = torch.arange(48, dtype=torch.float).view(16, 3)
    for r in range(2):
        write_local(buf, slice_full(src, 0, r, 2, True), 0, r, 2, True)
    assert torch.equal(buf, src)


def test_only_gated_fc1_is_glu():
    assert is_glu("decoder.layers.3.mlp.linear_fc1.weight", gated=True)
    assert not is_glu("decoder.layers.3.mlp.linear_fc1.weight", gated=False)
    assert not is_glu("decoder.layers.3.mlp.linear_fc2.weight", gated=True)
    # MoE: each expert's fc1 and the shared expert's are gated MLPs too; the router is not
    assert is_glu("decoder.layers.3.mlp.experts.local_experts.11.linear_fc1.weight", gated=True)
    assert is_glu("decoder.layers.3.mlp.shared_experts.linear_fc1.weight", gated=True)
    assert not is_glu("decoder.layers.3.mlp.experts.local_experts.11.linear_fc2.weight", gated=True)
    assert not is_glu("decoder.layers.3.mlp.router.weight", gated=True)
    assert not is_glu("decoder.layers.3.mlp.linear_fc1.layer_norm_weight", gated=True)
