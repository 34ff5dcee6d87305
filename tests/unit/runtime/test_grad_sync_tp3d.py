"""Gradient reduction with 3D tensor-parallel holders, simulated without processes: each bucket's
buffers are packed per rank with grad_sync's own write/contribution rules, summed, unpacked, and
every rank must end with its block of the sum of the replicas' full gradients (independent
reference: the full gradients themselves); the owned elements count every full element once."""

import pytest
import torch

from megatron_het.checkpoint.tp_layout import grid_index, slice_full
from megatron_het.runtime import grad_sync
from megatron_het.runtime.grad_sync import Holding, owned_norm_holdings, plan_buckets
from megatron_het.runtime.tp3d_groups import grid_full_shape, tp3d_holdings

H, FFN, QKV, VOCAB = 8, 16, 24, 16
L = "decoder.layers.0."
FULL = {  # global name -> (full shape, megatron partition_dim on a 1D stage)
    "embedding.word_embeddings.weight": ((VOCAB, H), 0),
    L + "input_layernorm.weight": ((H,), None), L + "input_layernorm.bias": ((H,), None),
    L + "self_attention.linear_qkv.weight": ((QKV, H), 0), L + "self_attention.linear_qkv.bias": ((QKV,), 0),
    L + "self_attention.linear_proj.weight": ((H, H), 1), L + "self_attention.linear_proj.bias": ((H,), None),
    L + "pre_mlp_layernorm.weight": ((H,), None), L + "pre_mlp_layernorm.bias": ((H,), None),
    L + "mlp.linear_fc1.weight": ((FFN, H), 0), L + "mlp.linear_fc1.bias": ((FFN,), 0),
    L + "mlp.linear_fc2.weight": ((H, FFN), 1), L + "mlp.linear_fc2.bias": ((H,), None),
    "decoder.final_layernorm.weight": ((H,), None),
}
GRIDS = [(2, 2, 1), (1, 2, 2), (2, 1, 2), (2, 2, 2), (1, 1, 4)]


def _grid_local(name, full, grid, r, *, dim):
    """What rank r of a 3D stage holds of ``full`` (the reference's own slicing, not grad_sync's)."""
    index = grid_index(name, tuple(full.shape), grid, r, gated=False)
    if index is not None:
        return full[index]
    y = (r // grid[0]) % grid[1]
    return full if dim is None else slice_full(full, dim, y, grid[1], False)


def _simulate(holdings, grads):
    """Run every bucket: pack (contributions), sum over the bucket's ranks, unpack into ``grads``."""
    by = {(h.name, h.rank): h for h in holdings}
    for b in plan_buckets(holdings):
        assert not b.direct or all(by[(n, r)].grid is None for n in b.names for r in b.ranks)
        for name in b.names:
            total = torch.zeros(by[(name, b.ranks[0])].full_shape, dtype=torch.float64)
            for r in b.ranks:
                h = by[(name, r)]
                buf = torch.zeros(h.full_shape, dtype=torch.float64)
                if grad_sync.contributes(h):
                    grad_sync._write(buf, grads[(name, r)], h)
                total += buf
            for r in b.ranks:
                grads[(name, r)] = grad_sync._slice(total, by[(name, r)]).clone()


def _three_d_replica(grid, G, *, rank0, stage_key, gen):
    """Holdings and local gradients of a 3D stage whose replica's full gradient is ``G``: linear
    weights complete, norms/biases split into random per-z parts that sum to G (rows of the batch)."""
    gx, gy, gz = grid
    parts = {}
    for name in G:
        if ("layernorm" in name or name.endswith(".bias")) and ".layers." in name:
            ps = [torch.randn(G[name].shape, dtype=torch.float64, generator=gen) for _ in range(gz - 1)]
            parts[name] = [*ps, G[name] - sum(ps, torch.zeros_like(G[name]))]
        else:
            parts[name] = [G[name]] * gz
    holdings, grads = [], {}
    for r in range(gx * gy * gz):
        z = r // (gx * gy)
        local = {n: _grid_local(n, parts[n][z], grid, r, dim=FULL[n][1]) for n in G}
        for n, t in local.items():
            dim = FULL[n][1] if ".layers." not in n else None
            assert grid_full_shape(n, tuple(t.shape), grid, dim) == FULL[n][0], n
        hs = tp3d_holdings({n: (tuple(t.shape), FULL[n][1] if ".layers." not in n else None) for n, t in local.items()},
                           rank=rank0 + r, grid_rank=r, stage_key=stage_key, grid=grid)
        holdings += hs
        grads.update({(n, rank0 + r): t.clone() for n, t in local.items()})
    return holdings, grads


def _one_d_replica(tp, G, *, rank0, stage_key):
    holdings, grads = [], {}
    for t in range(tp):
        for n, (shape, dim) in FULL.items():
            holdings.append(Holding(name=n, rank=rank0 + t, stage_key=stage_key, tp_rank=t, tp_size=tp,
                                    partition_dim=dim, full_shape=shape))
            grads[(n, rank0 + t)] = (G[n] if dim is None else slice_full(G[n], dim, t, tp, False)).clone()
    return holdings, grads


def _full_grads(gen):
    return {n: torch.randn(shape, dtype=torch.float64, generator=gen) for n, (shape, _) in FULL.items()}


@pytest.mark.parametrize("grid", GRIDS)
def test_3d_replica_beside_1d_replica_reduces_to_the_sum(grid):
    gen = torch.Generator().manual_seed(sum(grid))
    ga, gb = _full_grads(gen), _full_grads(gen)
    n3 = grid[0] * grid[1] * grid[2]
    h3, g3 = _three_d_replica(grid, ga, rank0=0, stage_key=(0, 0), gen=gen)
    h1, g1 = _one_d_replica(2, gb, rank0=n3, stage_key=(1, 0))
    holdings, grads = h3 + h1, {**g3, **g1}
    _simulate(holdings, grads)
    total = {n: ga[n] + gb[n] for n in FULL}
    for h in holdings:
        want = (_grid_local(h.name, total[h.name], h.grid, h.tp_rank, dim=FULL[h.name][1]) if h.grid is not None
                else total[h.name] if h.partition_dim is None else slice_full(total[h.name], h.partition_dim,
                                                                              h.tp_rank, h.tp_size, False))
        err = float((grads[(h.name, h.rank)] - want).abs().max())
        assert err < 1e-12, f"grid {grid}: rank {h.rank} {h.name} off by {err}"
    # the norm counts every full element once (owners are on the first stage: the 3D replica)
    owned = owned_norm_holdings(holdings)
    assert all(h.stage_key == (0, 0) for h in holdings if (h.name, h.rank) in owned)
    sq = sum(float(grads[key].pow(2).sum()) for key in owned)
    want_sq = sum(float(t.pow(2).sum()) for t in total.values())
    assert abs(sq - want_sq) < 1e-9 * want_sq, (grid, sq, want_sq)


@pytest.mark.parametrize("grid", [(1, 2, 2), (2, 1, 2), (1, 1, 4)])
def test_single_3d_stage_sums_norms_and_biases_over_z(grid):
    """One replica: only the layer norms and biases (partial over z) need a reduction."""
    gen = torch.Generator().manual_seed(7)
    ga = _full_grads(gen)
    holdings, grads = _three_d_replica(grid, ga, rank0=0, stage_key=(0, 0), gen=gen)
    buckets = plan_buckets(holdings)
    reduced = {n for b in buckets for n in b.names}
    assert reduced == {n for n in FULL if ".layers." in n and ("layernorm" in n or n.endswith(".bias"))}
    _simulate(holdings, grads)
    for h in holdings:
        want = _grid_local(h.name, ga[h.name], grid, h.tp_rank, dim=FULL[h.name][1])
        assert float((grads[(h.name, h.rank)] - want).abs().max()) < 1e-12, (grid, h.rank, h.name)


def test_single_3d_stage_without_z_needs_nothing():
    gen = torch.Generator().manual_seed(3)
    holdings, _ = _three_d_replica((2, 2, 1), _full_grads(gen), rank0=0, stage_key=(0, 0), gen=gen)
    assert plan_buckets(holdings) == []


def test_bad_grid_rank():
    with pytest.raises(ValueError, match=r"grid_rank: must be in \[0, 4\) for grid \[2, 2, 1\], got 4"):
        tp3d_holdings({}, rank=0, grid_rank=4, stage_key=(0, 0), grid=(2, 2, 1))
