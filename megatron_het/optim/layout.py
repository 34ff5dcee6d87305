"""Pure arithmetic of uneven sharding: who owns which flat elements, who computes which samples.

All of a rank's parameters are laid out one after another in a flat vector (in a fixed name
order every rank computes alike). Rank ``r`` owns the contiguous range ``[offset_r, offset_r +
size_r)`` of it; sizes follow the plan's shard fractions (largest-remainder rounding, so they sum
to the parameter count exactly). Samples of the global batch go to ranks in rank order, rank ``r``
taking ``micro_batch_size_r * num_micro_batches_r`` consecutive ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ShardLayout", "Segment", "FlatIndex", "shard_sizes", "sample_ranges", "proportional_split"]

_FRACTION_TOLERANCE = 1e-6  # fractions must sum to 1 within this (JSON round trips lose a little)


def proportional_split(total: int, weights: Sequence[float], *, field: str = "weights") -> tuple[int, ...]:
    """Split ``total`` into integers proportional to ``weights`` (largest remainder, ties to lower index)."""
    if not weights:
        raise ValueError(f"{field}: needs at least one entry (got []). Fix: pass one weight per rank")
    for i, w in enumerate(weights):
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
            raise ValueError(f"{field}[{i}]: must be a finite number >= 0 (got {w!r}). Fix: pass non-negative weights")
    s = float(sum(weights))
    if s <= 0:
        raise ValueError(f"{field}: must sum to > 0 (got {s}, limit 0). Fix: give at least one rank a positive weight")
    exact = [total * w / s for w in weights]
    base = [math.floor(x) for x in exact]
    left = total - sum(base)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - base[i]), i))
    for i in order[:left]:
        base[i] += 1
    return tuple(base)


def shard_sizes(numel: int, fractions: Sequence[float]) -> tuple[int, ...]:
    """Elements each rank owns of a flat vector of ``numel`` for shard ``fractions`` (sum 1)."""
    total = float(sum(fractions))
    if abs(total - 1.0) > _FRACTION_TOLERANCE:
        raise ValueError(f"shard_fractions: must sum to 1 (got {total:.9f}, limit 1 +- {_FRACTION_TOLERANCE}). "
                         "Fix: normalise the fractions")
    return proportional_split(numel, fractions, field="shard_fractions")


@dataclass(frozen=True, kw_only=True)
class ShardLayout:
    """Contiguous uneven ranges of a flat vector, one per rank of the data-parallel group."""

    sizes: tuple[int, ...]  # elements owned by each rank, in group-rank order (0 allowed)

    def __post_init__(self) -> None:
        for i, n in enumerate(self.sizes):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"sizes[{i}]: must be an integer >= 0 (got {n!r}). Fix: pass element counts")
        if not self.sizes:
            raise ValueError("sizes: needs at least one rank (got []). Fix: pass one size per rank")

    @classmethod
    def from_fractions(cls, numel: int, fractions: Sequence[float]) -> ShardLayout:
        return cls(sizes=shard_sizes(numel, fractions))

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def world(self) -> int:
        return len(self.sizes)

    @property
    def max_size(self) -> int:
        return max(self.sizes)

    def offset(self, rank: int) -> int:
        return sum(self.sizes[:rank])

    def range(self, rank: int) -> tuple[int, int]:
        """[start, stop) of ``rank``'s shard in the flat vector."""
        start = self.offset(rank)
        return start, start + self.sizes[rank]


@dataclass(frozen=True, kw_only=True)
class Segment:
    """The overlap of one parameter with one shard."""

    name: str  # global parameter name
    param_start: int  # first element inside the (flattened) parameter
    shard_start: int  # where those elements start inside the shard
    numel: int  # overlapping elements


@dataclass(frozen=True, kw_only=True)
class FlatIndex:
    """Where each named parameter sits in the flat vector (name order fixed by the caller)."""

    names: tuple[str, ...]  # parameter global names, flat order
    numels: tuple[int, ...]  # element count of each

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def offsets(self) -> dict[str, int]:
        out, pos = {}, 0
        for name, n in zip(self.names, self.numels):
            out[name] = pos
            pos += n
        return out

    def segments(self, start: int, stop: int) -> list[Segment]:
        """Pieces of parameters inside the flat range [start, stop), in flat order."""
        out, pos = [], 0
        for name, n in zip(self.names, self.numels):
            lo, hi = max(start, pos), min(stop, pos + n)
            if lo < hi:
                out.append(Segment(name=name, param_start=lo - pos, shard_start=lo - start, numel=hi - lo))
            pos += n
        return out


def sample_ranges(samples_per_rank: Sequence[int]) -> tuple[range, ...]:
    """Consecutive slices of the global batch, one per rank, in rank order."""
    out, pos = [], 0
    for i, n in enumerate(samples_per_rank):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"samples_per_rank[{i}]: must be an integer >= 0 (got {n!r}). Fix: pass sample counts")
        out.append(range(pos, pos + n))
        pos += n
    return tuple(out)
