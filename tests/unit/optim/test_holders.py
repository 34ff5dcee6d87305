"""Pure layout of the distributed optimizer over holders (optim/holders.py), no process groups.

Checked against independent references: tp_layout.slice_full (what a TP rank holds of a full
tensor) and direct enumeration of every element's holders.
"""

from __future__ import annotations

import pytest
import torch

from megatron_het.checkpoint.tp_layout import slice_full
from megatron_het.optim.holders import block, canonical_flat, plan_shard_buckets, write_canonical
from megatron_het.runtime.grad_sync import Holding


def _holdings(name, shape, dim, stages, glu=False):
    """stages: list of (first rank, tp_size) -> one Holding per TP rank."""
    out = []
    for i, (first, tp) in enumerate(stages):
        for r in range(tp):
            out.append(Holding(name=name, rank=first + r, stage_key=(i, 0), tp_rank=r, tp_size=tp,
                               partition_dim=dim, full_shape=shape, glu=glu))
    return out


@pytest.mark.parametrize("dim,glu", [(0, False), (1, False), (0, True)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_tp_rank_holds_a_contiguous_canonical_block(dim, glu, tp):
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    canon = canonical_flat(full, dim, glu)
    assert sorted(canon.tolist()) == full.reshape(-1).tolist()  # a permutation
    for r in range(tp):
        local = slice_full(full, dim, r, tp, glu)  # independent: what megatron gives TP rank r
        h = Holding(name="w", rank=r, stage_key=(0, 0), tp_rank=r, tp_size=tp, partition_dim=dim,
                    full_shape=(8, 12), glu=glu)
        lo, hi = block(h, full.numel())
        assert torch.equal(canonical_flat(local, dim, glu), canon[lo:hi])
        back = torch.zeros_like(local)
        write_canonical(back, canon[lo:hi], dim, glu)
        assert torch.equal(back, local)


def _check_ownership(buckets, holdings, weights=None):
    held = {}
    for h in holdings:
        n = torch.Size(h.full_shape).numel()
        held.setdefault(h.name, {})[h.rank] = block(h, n)
    owners = {}
    for b in buckets:
        for p in b.pieces:
            lo, hi = held[p.name][p.owner]
            assert lo <= p.start < p.stop <= hi, f"{p} is not inside what rank {p.owner} holds"
            for e in range(p.start, p.stop):
                assert (p.name, e) not in owners, f"{p.name}[{e}] owned twice"
                owners[(p.name, e)] = p.owner
    for name, blocks in held.items():
        n = max(hi for _, hi in blocks.values())
        assert all((name, e) in owners for e in range(n)), f"{name}: some element has no owner"
    return owners


def test_different_tp_sizes_share_every_element_once_among_its_holders():
    # replica 0 at TP2 (ranks 0, 1), replica 1 at TP4 (ranks 2..5): every element held twice
    hs = _holdings("w", (8, 4), 0, [(0, 2), (2, 4)]) + _holdings("norm", (4,), None, [(0, 2), (2, 4)])
    buckets = plan_shard_buckets(hs)
    owners = _check_ownership(buckets, hs)
    count = {r: sum(1 for (n, _), o in owners.items() if o == r and n == "w") for r in range(6)}
    # 32 elements held twice: each rank of TP2 holds 16, of TP4 8; each cell of 8 split 4/4
    assert count == {0: 8, 1: 8, 2: 4, 3: 4, 4: 4, 5: 4}
    norm = {r: sum(1 for (n, _), o in owners.items() if o == r and n == "norm") for r in range(6)}
    assert sum(norm.values()) == 4 and max(norm.values()) == 1  # replicated: one group of 6 holders


def test_same_tp_size_groups_holders_per_tp_rank_and_weights_make_shards_uneven():
    hs = _holdings("w", (8, 6), 1, [(0, 2), (2, 2)])
    buckets = plan_shard_buckets(hs, weights={0: 3.0, 1: 3.0, 2: 1.0, 3: 1.0})
    assert sorted(b.ranks for b in buckets) == [(0, 2), (1, 3)]
    owners = _check_ownership(buckets, hs)
    count = {r: sum(1 for o in owners.values() if o == r) for r in range(4)}
    assert count == {0: 18, 1: 18, 2: 6, 3: 6}  # 24 elements per TP block split 3:1


def test_bad_weight_is_refused_naming_the_rank():
    with pytest.raises(ValueError, match=r"weights\[1\].*>= 0.*-2"):
        plan_shard_buckets(_holdings("w", (4, 4), 0, [(0, 2)]), weights={0: 1.0, 1: -2.0})


def test_owner_layout_puts_each_owners_pieces_together():
    hs = _holdings("a", (8,), 0, [(0, 2), (2, 4)]) + _holdings("b", (8, 2), 0, [(0, 2), (2, 4)])
    (bucket,) = [b for b in plan_shard_buckets(hs) if len(b.ranks) == 6]
    layout = bucket.owner_layout()
    owners = [p.owner for p, _ in layout]
    assert owners == sorted(owners)
    assert [pos for _, pos in layout] == [sum(p.stop - p.start for p, _ in layout[:k]) for k in range(len(layout))]
    assert sum(p.stop - p.start for p, _ in layout) == bucket.numel == sum(bucket.sizes())
