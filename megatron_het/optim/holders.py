"""Pure layout of the distributed optimizer over the *holders* of each full parameter.

In the pipeline runtime a full parameter (global name) is held by several ranks: every replica's
stage that has the layer, each of its TP ranks holding a slice (or all of it, for a replicated
parameter), and possibly with different TP sizes per replica. Megatron-core's
``DistributedOptimizer`` shards one flat buffer that is laid out identically on every DP rank;
replicas with different TP sizes have no such common layout, so the shards here are defined over
the full tensor instead.

**Canonical order.** A full tensor is flattened with its TP partition dim first (for a gated MLP's
``[gate; up]`` the gate and up rows of one TP block side by side), so TP rank ``r`` of ``t`` holds
the contiguous canonical range ``[r*N/t, (r+1)*N/t)`` whatever ``t`` is. A holder's block is that
range (the whole ``[0, N)`` for a replicated parameter).

**Groups.** A parameter whose holders all have one TP size is sharded among the holders of each
TP block separately (the same slice; Megatron's DP group per TP rank). Otherwise (TP sizes
differ, or the parameter is replicated across TP ranks) all holders form one group over the full
range. Parameters with the same group go in one bucket, in backward order.

**Ownership.** Inside a bucket, each parameter's range is cut at every member's block boundary
into cells; every cell is split among the members whose block covers it, in proportion to their
``weights`` (free memory; largest-remainder rounding), ascending rank order. So each rank owns a
slice of what it holds, every element has exactly one owner, and the definition depends only on
global names, full shapes and who holds what (never on one rank's local layout).

Everything here is deterministic from the gathered holdings, tested without process groups
(``tests/unit/optim``); ``optim/distributed.py`` creates the groups and moves the data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from megatron_het.optim.layout import proportional_split

__all__ = ["Piece", "ShardBucket", "block", "canonical_flat", "plan_shard_buckets", "write_canonical"]


@dataclass(frozen=True, kw_only=True)
class Piece:
    """A contiguous canonical range of one parameter owned by one rank."""

    name: str  # global parameter name
    start: int  # first canonical element of the full tensor
    stop: int  # one past the last
    owner: int  # global rank that keeps the fp32 main value and Adam moments of these elements


@dataclass(frozen=True, kw_only=True)
class ShardBucket:
    """Parameters whose gradients are reduce-scattered (and values all-gathered) over one group."""

    ranks: tuple[int, ...]  # the group, ascending global ranks; group rank = index here
    names: tuple[str, ...]  # parameters in buffer order (backward order)
    spans: tuple[tuple[int, int], ...]  # canonical range of each name carried by the buffer
    pieces: tuple[Piece, ...]  # ownership, in buffer order

    @property
    def numel(self) -> int:
        """Elements of the bucket's buffer (sum of the spans)."""
        return sum(stop - start for start, stop in self.spans)

    def owner_layout(self) -> list[tuple[Piece, int]]:
        """Every piece with its position in the owner-ordered buffer (each owner's pieces contiguous,
        owners in ``ranks`` order): the uneven reduce-scatter's input and all-gather's output layout."""
        by_owner: dict[int, list[Piece]] = {r: [] for r in self.ranks}
        for p in self.pieces:
            by_owner[p.owner].append(p)
        out, pos = [], 0
        for r in self.ranks:
            for p in by_owner[r]:
                out.append((p, pos))
                pos += p.stop - p.start
        return out

    def local_segments(self, blocks: Mapping[str, tuple[int, int]]) -> dict[str, list[tuple[int, int, int]]]:
        """Where a member's own blocks sit in the owner-ordered buffer: for each of its names (``blocks``:
        name -> canonical block it holds), (buffer position, offset in the block, elements) runs that
        cover the block. The reduce-scatter's input is written from them and the all-gather's output
        read through them, with no buffer in canonical order beside the owner-ordered one."""
        out: dict[str, list[tuple[int, int, int]]] = {n: [] for n in self.names if n in blocks}
        for p, pos in self.owner_layout():
            if p.name not in out:
                continue
            bs, be = blocks[p.name]
            a, z = max(p.start, bs), min(p.stop, be)
            if a < z:
                out[p.name].append((pos + a - p.start, a - bs, z - a))
        return out

    def sizes(self) -> tuple[int, ...]:
        """Elements each group rank owns (the uneven collectives' layout)."""
        count = dict.fromkeys(self.ranks, 0)
        for p in self.pieces:
            count[p.owner] += p.stop - p.start
        return tuple(count[r] for r in self.ranks)

    def pieces_of(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.owner == rank]


def block(h, numel: int) -> tuple[int, int]:
    """Canonical range [start, stop) of the full tensor that holding ``h`` holds."""
    if h.partition_dim is None:
        return 0, numel
    if numel % h.tp_size:
        raise ValueError(f"{h.name}: {numel} elements do not split over tp_size {h.tp_size} "
                         f"(remainder {numel % h.tp_size}). Fix: a TP size must divide the partitioned dim")
    n = numel // h.tp_size
    return h.tp_rank * n, (h.tp_rank + 1) * n


def canonical_flat(x: torch.Tensor, partition_dim: int | None, glu: bool) -> torch.Tensor:
    """``x`` (a full tensor or one TP slice of it) flattened in canonical order (a copy when needed)."""
    if partition_dim is None:
        return x.reshape(-1)
    y = x.movedim(partition_dim, 0)
    if glu:
        y = y.reshape(2, y.shape[0] // 2, *y.shape[1:]).transpose(0, 1)
    return y.reshape(-1)


def write_canonical(x: torch.Tensor, flat: torch.Tensor, partition_dim: int | None, glu: bool) -> None:
    """Inverse of ``canonical_flat``: copy the canonical ``flat`` into ``x`` (casting to its dtype)."""
    if partition_dim is None:
        x.copy_(flat.view(x.shape))
        return
    moved = list(x.movedim(partition_dim, 0).shape)
    if glu:
        y = flat.view(moved[0] // 2, 2, *moved[1:]).transpose(0, 1).reshape(moved)
    else:
        y = flat.view(moved)
    x.copy_(y.movedim(0, partition_dim))


def _split_cells(name: str, span: tuple[int, int], blocks: Mapping[int, tuple[int, int]],
                 weights: Mapping[int, float]) -> list[Piece]:
    lo, hi = span
    cuts = sorted({lo, hi, *(c for b in blocks.values() for c in b if lo < c < hi)})
    pieces = []
    for a, b in zip(cuts, cuts[1:]):
        holders = sorted(r for r, (s, e) in blocks.items() if s <= a and b <= e)
        if not holders:
            raise ValueError(f"{name}: canonical elements [{a}, {b}) have no holder among ranks {sorted(blocks)}. "
                             "Fix: every element of a group's span must be held by a member")
        sizes = proportional_split(b - a, [float(weights.get(r, 1.0)) for r in holders], field=f"weights of {name}")
        pos = a
        for r, n in zip(holders, sizes):
            if n:
                pieces.append(Piece(name=name, start=pos, stop=pos + n, owner=r))
            pos += n
    return pieces


def plan_shard_buckets(holdings: Iterable, *, weights: Mapping[int, float] | None = None,
                       bucket_numel: int | None = None) -> list[ShardBucket]:
    """Buckets and ownership for every parameter of every rank (deterministic: every rank gets the
    same list). ``holdings``: ``runtime.grad_sync.Holding``-like records of the whole world;
    ``weights``: rank -> share weight (free memory, or a sharded plan's fraction; 0: owns nothing,
    but every element needs one holder of weight > 0; None: equal); ``bucket_numel``: close a bucket
    once it carries that many elements (None: one bucket per group)."""
    weights = dict(weights or {})
    for r, w in weights.items():
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
            raise ValueError(f"weights[{r}]: must be a finite number >= 0 (got {w!r}). "
                             "Fix: pass each rank's free memory in bytes (or its shard fraction)")
    holdings = list(holdings)
    by_name: dict[str, list] = {}
    first_seen: dict[str, int] = {}
    for i, h in enumerate(holdings):
        by_name.setdefault(h.name, []).append(h)
        first_seen.setdefault(h.name, i)
    groups: dict[tuple[int, ...], list[tuple[str, tuple[int, int], dict[int, tuple[int, int]]]]] = {}
    for name in sorted(by_name, key=lambda n: -first_seen[n]):
        hs = by_name[name]
        numel = int(torch.Size(hs[0].full_shape).numel())
        blocks = {h.rank: block(h, numel) for h in hs}
        partitioned = all(h.partition_dim is not None for h in hs)
        if partitioned and len({h.tp_size for h in hs}) == 1:
            for b in sorted(set(blocks.values())):
                members = {r: blk for r, blk in blocks.items() if blk == b}
                groups.setdefault(tuple(sorted(members)), []).append((name, b, members))
        else:
            groups.setdefault(tuple(sorted(blocks)), []).append((name, (0, numel), blocks))
    buckets = []
    for ranks in sorted(groups):
        current: list = []
        size = 0
        for entry in groups[ranks]:
            current.append(entry)
            size += entry[1][1] - entry[1][0]
            if bucket_numel is not None and size >= bucket_numel:
                buckets.append(_bucket(ranks, current, weights))
                current, size = [], 0
        if current:
            buckets.append(_bucket(ranks, current, weights))
    return buckets


def _bucket(ranks: tuple[int, ...], entries: Sequence, weights: Mapping[int, float]) -> ShardBucket:
    pieces = [p for name, span, blocks in entries for p in _split_cells(name, span, blocks, weights)]
    return ShardBucket(ranks=ranks, names=tuple(e[0] for e in entries), spans=tuple(e[1] for e in entries),
                       pieces=tuple(pieces))
