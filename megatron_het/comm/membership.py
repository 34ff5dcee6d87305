"""Who is on which island, and the pure topology of a hierarchical group (no process groups)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_het.errors import UserError
from megatron_het.platform import TORCH_BACKENDS  # torch names: RCCL is torch's "nccl" on ROCm builds


class CommConfigError(UserError):
    """A hierarchical group was asked for with inconsistent ranks, islands or settings."""


@dataclass(frozen=True, kw_only=True)
class IslandMembership:
    """Which island each global rank belongs to and which torch backend each island speaks."""

    rank_to_island: Mapping[int, str]  # global rank -> island name
    island_backend: Mapping[str, str]  # island name -> a torch backend name of platform.TORCH_BACKENDS

    def __post_init__(self) -> None:
        for rank, island in self.rank_to_island.items():
            if island not in self.island_backend:
                raise CommConfigError(
                    f"rank_to_island[{rank}] = {island!r} has no entry in island_backend "
                    f"(known islands: {sorted(self.island_backend)}); add {island!r}: one of {list(TORCH_BACKENDS)}")
        for island, backend in self.island_backend.items():
            if backend not in TORCH_BACKENDS:
                raise CommConfigError(
                    f"island_backend[{island!r}] = {backend!r} is not a torch backend name; use one of "
                    f"{list(TORCH_BACKENDS)} (RCCL is 'nccl' on ROCm builds of torch)")


@dataclass(frozen=True, kw_only=True)
class HetTopology:
    """A group's islands in a fixed order shared by every rank (pure data, built by `plan_topology`)."""

    ranks: tuple[int, ...]  # global ranks of the group, ascending; group rank = index here
    islands: tuple[str, ...]  # island names ordered by leader rank; island index = leaders-group rank
    members: tuple[tuple[int, ...], ...]  # per island index: its global ranks, ascending
    backends: tuple[str, ...]  # per island index: native torch backend

    @property
    def leaders(self) -> tuple[int, ...]:
        """Global rank of each island's leader (its lowest rank), in island order."""
        return tuple(m[0] for m in self.members)

    @property
    def shards(self) -> int:
        """Pieces a cross-island all-reduce is cut into: the fewest members of any island (member j
        of every island exchanges piece j over its own link); 1 for one island (reduce to the
        leader, broadcast back: nothing crosses)."""
        return min(len(m) for m in self.members) if len(self.members) > 1 else 1

    def island_of(self, global_rank: int) -> int:
        """Island index of a global rank of the group."""
        for i, m in enumerate(self.members):
            if global_rank in m:
                return i
        raise CommConfigError(f"rank {global_rank} is not in this group (ranks {list(self.ranks)})")

    def group_rank(self, global_rank: int) -> int:
        """Rank inside the group (position in `ranks`)."""
        if global_rank not in self.ranks:
            raise CommConfigError(f"rank {global_rank} is not in this group (ranks {list(self.ranks)})")
        return self.ranks.index(global_rank)

    def island_of_group_rank(self) -> list[int]:
        """Per group rank: its island index."""
        return [self.island_of(r) for r in self.ranks]

    def intra_rank_of_group_rank(self) -> list[int]:
        """Per group rank: its rank inside its island's group."""
        return [self.members[self.island_of(r)].index(r) for r in self.ranks]

    def leader_group_ranks(self) -> list[int]:
        """Per island index: the group rank of its leader."""
        return [self.ranks.index(r) for r in self.leaders]


def shard_sizes(numel: int, shards: int) -> list[int]:
    """Elements of each of ``shards`` contiguous, nearly equal pieces of ``numel`` (the first
    ``numel % shards`` one longer); pieces are empty when ``numel < shards``. Same on every rank."""
    base, extra = divmod(numel, shards)
    return [base + (1 if j < extra else 0) for j in range(shards)]


def _check_ranks(ranks: Sequence[int], membership: IslandMembership) -> tuple[int, ...]:
    if len(ranks) == 0:
        raise CommConfigError("ranks is empty; pass the global ranks of the group (at least one)")
    if len(set(ranks)) != len(ranks):
        dup = sorted({r for r in ranks if list(ranks).count(r) > 1})
        raise CommConfigError(f"ranks lists {dup} more than once; list each global rank once")
    unknown = [r for r in ranks if r not in membership.rank_to_island]
    if unknown:
        raise CommConfigError(f"ranks {unknown} have no island in membership.rank_to_island; "
                              f"add them (known ranks: {sorted(membership.rank_to_island)})")
    return tuple(sorted(int(r) for r in ranks))


def needs_bridge(ranks: Sequence[int], membership: IslandMembership) -> bool:
    """True if `ranks` span islands whose native backends differ (one communicator cannot hold them)."""
    ordered = _check_ranks(ranks, membership)
    return len({membership.island_backend[membership.rank_to_island[r]] for r in ordered}) > 1


def plan_topology(ranks: Sequence[int], membership: IslandMembership) -> HetTopology:
    """Order islands by their lowest rank and list each island's members; same answer on every rank."""
    ordered = _check_ranks(ranks, membership)
    by_island: dict[str, list[int]] = {}
    for r in ordered:
        by_island.setdefault(membership.rank_to_island[r], []).append(r)
    names = sorted(by_island, key=lambda name: by_island[name][0])
    return HetTopology(ranks=ordered, islands=tuple(names),
                       members=tuple(tuple(by_island[n]) for n in names),
                       backends=tuple(membership.island_backend[n] for n in names))
