"""Every holder of a parameter holds the same value: a check the runtime can run at any step.

Megatron-LM's ``--check-weight-hash-across-dp-replicas-interval`` compares a hash of each parameter
across data-parallel replicas, which hold identical shards. Here holders of one full parameter may
hold different pieces of it (replicas of other TP sizes, a tied embedding's copy on the last stage,
a 3D stage's blocks) and TP ranks hold copies of the replicated ones (norms, row-parallel biases,
position embeddings). So each full tensor is cut into *cells*: the coarsest grid such that every
holder's piece is a union of whole cells (from the holdings alone, a pure function). Every holder
hashes each cell it holds; the digests are gathered world-wide and every rank compares them, so all
ranks reach the same verdict (no rank raises alone and leaves the others waiting in a collective).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_het.runtime.grad_sync import Holding, held_indices

__all__ = ["HolderMismatch", "WeightMismatchError", "cell_grid", "check_holders_agree"]

Cell = tuple[tuple[int, int], ...]  # [start, stop) per dim of the full tensor


def _cuts(indices: torch.Tensor, n: int) -> set[int]:
    """Where a holder's index set starts or stops along one dim (0 and n included)."""
    cuts = {0, n}
    if indices.numel():
        steps = torch.nonzero(indices[1:] != indices[:-1] + 1).reshape(-1)
        cuts |= {int(indices[0]), int(indices[-1]) + 1}
        cuts |= {int(indices[i]) + 1 for i in steps} | {int(indices[i + 1]) for i in steps}
    return cuts


def cell_grid(holders: Sequence[Holding]) -> list[Cell]:
    """The cells of one full parameter: the product, over dims, of the intervals between every
    holder's cuts. Pure and deterministic (every rank computes the same list)."""
    shape = holders[0].full_shape
    cuts = [set() for _ in shape]
    for h in holders:
        for d, idx in enumerate(held_indices(h)):
            cuts[d] |= _cuts(idx, shape[d])
    axes = [list(itertools.pairwise(sorted(c))) for c in cuts]
    return list(itertools.product(*axes))


def _local_cells(h: Holding, cells: Iterable[Cell]) -> list[tuple[Cell, tuple[slice, ...]]]:
    """The cells ``h`` holds whole, each with its place in the local tensor."""
    indices = held_indices(h)
    out = []
    for cell in cells:
        where = []
        for (start, stop), idx in zip(cell, indices):
            pos = torch.nonzero(idx == start).reshape(-1)
            if not pos.numel():
                break
            where.append(slice(int(pos[0]), int(pos[0]) + stop - start))
        else:
            out.append((cell, tuple(where)))
    return out


@dataclass(frozen=True, kw_only=True)
class HolderMismatch:
    """One cell of one parameter whose holders disagree."""

    name: str  # global parameter name
    cell: Cell  # the full tensor's region, [start, stop) per dim
    sums: Mapping[int, float]  # rank -> float64 sum of its copy of the cell
    groups: tuple[tuple[int, ...], ...]  # ranks with identical bytes, one tuple per distinct value

    def describe(self) -> str:
        region = "[" + ", ".join(f"{a}:{b}" for a, b in self.cell) + "]"
        values = "; ".join(f"ranks {list(g)} sum {self.sums[g[0]]:.9g}" for g in self.groups)
        spread = max(self.sums.values()) - min(self.sums.values())
        return f"{self.name}{region}: {values} (sums differ by {spread:.3g})"


class WeightMismatchError(RuntimeError):
    """Holders of a parameter hold different values: the run is no longer one model."""


@torch.no_grad()
def check_holders_agree(local: Sequence[Holding], params: Mapping[str, torch.Tensor], *,
                        context: str = "") -> int:
    """Collective over the world: compare every cell of every parameter across its holders.

    ``local``: this rank's holdings; ``params``: its tensors by the same global names. Returns the
    number of cells compared; raises ``WeightMismatchError`` on every rank, naming each differing
    parameter, its region, the ranks on each side and their sums, when any holder differs."""
    gathered: list[list[Holding] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(local))
    by_name: dict[str, list[Holding]] = {}
    for h in (h for hs in gathered for h in hs):
        by_name.setdefault(h.name, []).append(h)
    digests = []
    for h in local:
        tensor = params[h.name].detach()
        for cell, where in _local_cells(h, cell_grid(by_name[h.name])):
            piece = tensor[where].contiguous().cpu()
            raw = piece.view(torch.uint8) if piece.numel() else piece
            digests.append((h.name, cell, h.rank, hashlib.sha256(raw.numpy().tobytes()).hexdigest(),
                            float(piece.double().sum())))
    everyone: list[list | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digests)
    cells: dict[tuple[str, Cell], dict[int, tuple[str, float]]] = {}
    for name, cell, rank, digest, total in (d for ds in everyone for d in ds):
        cells.setdefault((name, cell), {})[rank] = (digest, total)
    bad = []
    for (name, cell), by_rank in sorted(cells.items()):
        if len({digest for digest, _ in by_rank.values()}) > 1:
            groups: dict[str, list[int]] = {}
            for rank, (digest, _) in sorted(by_rank.items()):
                groups.setdefault(digest, []).append(rank)
            bad.append(HolderMismatch(name=name, cell=cell, sums={r: t for r, (_, t) in by_rank.items()},
                                      groups=tuple(tuple(g) for g in groups.values())))
    if bad:
        lines = "\n  ".join(m.describe() for m in bad[:20])
        more = f"\n  ... and {len(bad) - 20} more cells" if len(bad) > 20 else ""
        raise WeightMismatchError(f"{context}holders of {len({m.name for m in bad})} parameter(s) hold different "
                                  f"values (every holder of a parameter must hold the same):\n  {lines}{more}")
    return len(cells)
