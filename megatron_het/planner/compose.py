"""Composition over islands (Tangram): replicas of different shapes that together use every island.

A *shape* is one replica's pipeline as a chain of (island, TP, stages) segments: a contiguous
model slice per stage, the slices balanced by the parallelizer's stage costs under memory caps
(``Estimator.replica_line``). Shapes are priced one replica at a time, then composed: how many
replicas of each shape to run is a small linear program,

    maximise sum_s n_s * rate_s   subject to   sum_s n_s * gpus_s[i] <= G_i (every island i),
                                               sum_s n_s <= micro-batches,

where ``rate_s = m / (A_s + (m - 1) T_s + tail_s)`` is a replica's throughput at m micro-batches
(m = the micro-batches per replica of the composition, refined once; the tail is its gradient
reduction past its end, peers assumed on its own islands, and its optimizer step). The LP optimum is rounded down and the
GPUs left over are filled greedily with the best shape that still fits, so that islands are not left
idle for want of a replica of the right size. Each composition is then priced in full closed form
(gradient reduction over the islands included) by the caller and refined by hill climbing.

Pruning keeps this fast at thousands of GPUs: a chain holds at most three islands, each island uses
its best one or two TP sizes (from the island's own best layouts), at most ``_CHAIN_PP`` stages per
island in a multi-island chain, and among shapes with the same GPUs on every island only those not beaten
in both fill and period by another enter the LP.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_het.planner.estimate import Estimator
from megatron_het.planner.space import Segment, Template

__all__ = ["Shape", "compose", "solve_lp"]

_CHAIN_PP = (1, 2, 3, 4, 6, 8)  # stages one island may take in a multi-island chain
_LOCAL_PP = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80)  # stages of a one-island chain
_MAX_CHAIN = 3  # islands per chain
_REFINE = 2  # LP solves, each with the micro-batches per replica of the previous composition
_PAIR_SHAPES = 4  # fast mode: best shapes by rate per GPU paired (plus the best of every island set)
_PAIR_SHAPES_EXHAUSTIVE = 12  # exhaustive mode: best shapes whose pairs are composed at every count
_TIE = 1e-3  # fill_idle: an addition this close to the best so far counts as a tie and is kept exploring


@dataclass(frozen=True, kw_only=True)
class Shape:
    """One replica layout and its closed-form line."""

    template: Template  # segments of the replica (count 1)
    gpus: tuple[int, ...]  # GPUs per island (full cluster indexing) for one replica
    fill_s: float  # A: one micro-batch through the pipeline and back
    period_s: float  # T: steady-state time per further micro-batch
    tail_s: float  # gradient reduction past the pipeline's end (peers on the same island) + optimizer step

    def rate(self, m: float) -> float:
        """Micro-batches per second of one replica running ``m`` micro-batches, per iteration."""
        return m / (self.fill_s + (m - 1) * self.period_s + self.tail_s)


def solve_lp(c: np.ndarray, a: np.ndarray, b: np.ndarray, *, max_iter: int = 500) -> np.ndarray:
    """max c.x s.t. a x <= b, x >= 0 with b >= 0 (so the slack basis is feasible): dense simplex,
    Bland's rule (no cycling). Small here: one row per island plus one, a column per shape."""
    rows, cols = a.shape
    tab = np.zeros((rows + 1, cols + rows + 1))
    tab[:rows, :cols] = a
    tab[:rows, cols:cols + rows] = np.eye(rows)
    tab[:rows, -1] = b
    tab[rows, :cols] = -c
    basis = list(range(cols, cols + rows))
    for _ in range(max_iter):
        entering = np.flatnonzero(tab[rows, :-1] < -1e-12)
        if entering.size == 0:
            break
        e = int(entering[0])
        col = tab[:rows, e]
        ratios = np.where(col > 1e-12, tab[:rows, -1] / np.where(col > 1e-12, col, 1.0), np.inf)
        best = ratios.min()
        if not np.isfinite(best):  # unbounded: cannot happen with positive GPU rows
            break
        leave = int(min((r for r in range(rows) if ratios[r] <= best + 1e-12), key=lambda r: basis[r]))
        tab[leave] /= tab[leave, e]
        for r in range(rows + 1):
            if r != leave and tab[r, e] != 0.0:
                tab[r] -= tab[r, e] * tab[leave]
        basis[leave] = e
    x = np.zeros(cols)
    for r, v in enumerate(basis):
        if v < cols:
            x[v] = tab[r, -1]
    return x


def _chains(active: Sequence[int]) -> list[tuple[int, ...]]:
    return [order for r in range(1, min(_MAX_CHAIN, len(active)) + 1)
            for subset in itertools.combinations(active, r) for order in itertools.permutations(subset)]


def shapes(est: Estimator, active: Sequence[int], *, tps: Mapping[int, Sequence[int]], mbs: int, recompute: bool,
           replicas: int, exhaustive: bool = False) -> list[Shape]:
    """Every priced, non-dominated shape over chains of the active islands (``exhaustive``: every
    TP size of ``tps`` in 3-island chains too, not only the first)."""
    cluster, L = est.cluster, est.model.num_layers
    out: list[Shape] = []
    for chain in _chains(active):
        per_island = []
        for i in chain:
            g = cluster.islands[i].num_gpus
            pps = _LOCAL_PP if len(chain) == 1 else _CHAIN_PP
            use = tps[i] if len(chain) < 3 or exhaustive else tps[i][:1]
            per_island.append([(tp, pp) for tp in use for pp in pps if tp * pp <= g and pp <= L])
        for combo in itertools.product(*per_island):
            if sum(pp for _, pp in combo) > L:
                continue
            t = Template(segments=tuple(Segment(island=i, tp=tp, pp=pp) for i, (tp, pp) in zip(chain, combo)),
                         count=1)
            line = est.replica_line(t, mbs, recompute, replicas=replicas)
            if line is None:
                continue
            gpus = [0] * len(cluster.islands)
            for i, (tp, pp) in zip(chain, combo):
                gpus[i] = tp * pp
            out.append(Shape(template=t, gpus=tuple(gpus), fill_s=line[0], period_s=line[1], tail_s=line[2]))
    return _undominated(out)


def _undominated(found: Sequence[Shape]) -> list[Shape]:
    """Among shapes using the same GPUs on every island, drop those no faster in fill and period."""
    groups: dict[tuple[int, ...], list[Shape]] = {}
    for s in found:
        groups.setdefault(s.gpus, []).append(s)
    out = []
    for group in groups.values():
        best_fill = float("inf")
        for s in sorted(group, key=lambda s: (s.period_s, s.fill_s + s.tail_s)):
            if s.fill_s + s.tail_s < best_fill:
                out.append(s)
                best_fill = s.fill_s + s.tail_s
    return out


def _round(shapes_: Sequence[Shape], x: np.ndarray, free: list[int], max_replicas: int, m: float) -> dict[int, int]:
    """Floor the LP counts, then add the best-rate shape that still fits until none does."""
    counts = {s: int(v + 1e-9) for s, v in enumerate(x) if v >= 1 - 1e-9}
    for s, n in counts.items():
        free = [f - n * g for f, g in zip(free, shapes_[s].gpus)]
    total = sum(counts.values())
    order = sorted(range(len(shapes_)), key=lambda s: -shapes_[s].rate(m))
    while total < max_replicas:
        pick = next((s for s in order if all(g <= f for g, f in zip(shapes_[s].gpus, free))), None)
        if pick is None:
            break
        counts[pick] = counts.get(pick, 0) + 1
        free = [f - g for f, g in zip(free, shapes_[pick].gpus)]
        total += 1
    return counts


def compose(est: Estimator, active: Sequence[int], *, tps: Mapping[int, Sequence[int]], mbs: int, recompute: bool,
            bases: Sequence[tuple[Template, ...]], exhaustive: bool = False) -> list[tuple[Template, ...]]:
    """Compositions (structures of templates with counts) to price: the LP's, then ``bases``
    (the caller's best plans at this micro-batch size and recompute setting, best first) and the LP's
    with their idle GPUs filled by further replicas (:func:`fill_idle`).

    Shapes are priced for the replica count of ``bases[0]`` (memory shards, micro-batches in flight).
    Pairs of shapes (:func:`shape_pairs`) are added in both modes. ``exhaustive`` (small clusters,
    the optimality reference): every TP size in every chain, idle GPUs filled trying every shape
    until none fits, and pairs of the _PAIR_SHAPES_EXHAUSTIVE best shapes at every count."""
    replicas = sum(t.count for t in bases[0]) if bases else 1
    found = shapes(est, active, tps=tps, mbs=mbs, recompute=recompute, replicas=max(1, replicas),
                   exhaustive=exhaustive)
    if not found:
        return []
    out = lp_compositions(est, active, found, mbs=mbs, replicas=replicas)
    for base in list(bases) + list(out):
        more = fill_idle(est, base, found, mbs=mbs, recompute=recompute,
                         **({"rounds": 64, "tries": len(found)} if exhaustive else {}))
        out += [s for s in more if s not in out]
    out += [s for s in shape_pairs(est, found, mbs=mbs, replicas=replicas, exhaustive=exhaustive) if s not in out]
    return out


def shape_pairs(est: Estimator, found: Sequence[Shape], *, mbs: int, replicas: int, exhaustive: bool = False
                ) -> list[tuple[Template, ...]]:
    """Two-shape compositions: some replicas of one shape, the second filling what is left (at most
    the micro-batch count in all). The LP prices each shape as if its layers were reduced on its own
    islands; these pairs let the full closed form judge mixes the LP misranks.

    Shapes: the best by rate per GPU and the best for every set of islands, _PAIR_SHAPES of them
    (exhaustive: the _PAIR_SHAPES_EXHAUSTIVE best); counts of the first: every count when
    ``exhaustive``, else 1, 2, 4, ... and the largest few."""
    total_mb = est.global_batch_size // mbs
    m = max(1.0, total_mb / max(1, replicas))
    ranked = sorted(found, key=lambda s: -s.rate(m) / sum(s.gpus))
    if exhaustive:
        best = ranked[:_PAIR_SHAPES_EXHAUSTIVE]
    else:
        per_set: dict[tuple[bool, ...], Shape] = {}
        for s in ranked:
            per_set.setdefault(tuple(g > 0 for g in s.gpus), s)
        best = list(dict.fromkeys(ranked[:_PAIR_SHAPES] + list(per_set.values())))
    caps = [i.num_gpus for i in est.cluster.islands]
    out = []
    for a, b in itertools.permutations(best, 2):
        most_a = min(min(c // g for c, g in zip(caps, a.gpus) if g), total_mb - 1)
        if exhaustive:
            counts = range(1, most_a + 1)
        else:
            counts = sorted({1 << k for k in range(most_a.bit_length()) if 1 << k <= most_a}
                            | {n for n in range(most_a - 2, most_a + 1) if n >= 1})
        for n in counts:
            left = [c - n * g for c, g in zip(caps, a.gpus)]
            k = min(min(c // g for c, g in zip(left, b.gpus) if g), total_mb - n)
            if k >= 1:
                out.append((Template(segments=a.template.segments, count=n),
                            Template(segments=b.template.segments, count=k)))
    return out


def lp_compositions(est: Estimator, active: Sequence[int], found: Sequence[Shape], *, mbs: int,
                    replicas: int) -> list[tuple[Template, ...]]:
    """The LP's compositions, rounded (one per refinement of the micro-batches per replica)."""
    total_mb = est.global_batch_size // mbs
    free = [est.cluster.islands[i].num_gpus if i in set(active) else 0 for i in range(len(est.cluster.islands))]
    a = np.array([[s.gpus[i] for s in found] for i in range(len(free))] + [[1] * len(found)], dtype=float)
    b = np.array(free + [total_mb], dtype=float)
    m = total_mb / max(1, replicas)
    out: list[tuple[Template, ...]] = []
    for _ in range(_REFINE):
        x = solve_lp(np.array([s.rate(max(1.0, m)) for s in found]), a, b)
        counts = _round(found, x, list(free), total_mb, max(1.0, m))
        if not counts:
            break
        structure = tuple(Template(segments=found[s].template.segments, count=n)
                          for s, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        if structure not in out:
            out.append(structure)
        m = total_mb / sum(counts.values())
    return out


def fill_idle(est: Estimator, base: tuple[Template, ...], found: Sequence[Shape], *, mbs: int, recompute: bool,
              rounds: int = 3, tries: int = 12) -> list[tuple[Template, ...]]:
    """Put idle GPUs to work around a good plan: add replicas of the shapes that fit in what
    ``base`` leaves free, up to ``rounds`` times; each round keeps the addition with the best
    closed-form iteration time, also when it only ties (micro-batches are whole: a few more
    replicas may not lower the largest count per replica, a few more after them may). Returns the
    structure after each round."""
    n_isl = len(est.cluster.islands)
    total_mb = est.global_batch_size // mbs
    best = est.evaluate(base, mbs, recompute)
    if isinstance(best, str):
        return []
    out = []
    current = base
    for _ in range(rounds):
        used = [0] * n_isl
        for t in current:
            for s in t.segments:
                used[s.island] += t.count * s.tp * s.pp
        free = [i.num_gpus - u for i, u in zip(est.cluster.islands, used)]
        replicas = sum(t.count for t in current)
        m = total_mb / max(1, replicas)
        options = []
        for s in found:
            n = min((f // g for f, g in zip(free, s.gpus) if g), default=0)
            n = min(n, total_mb - replicas)
            if n >= 1:
                options.append((-n * s.rate(max(1.0, m)), n, s))
        options.sort(key=lambda o: o[0])
        improved, best_round = None, None
        for _, n, s in options[:tries]:
            for k in dict.fromkeys((n, max(1, n // 2))):
                same = next((j for j, t in enumerate(current) if t.segments == s.template.segments), None)
                if same is None:
                    structure = current + (Template(segments=s.template.segments, count=k),)
                else:
                    t = current[same]
                    structure = current[:same] + (Template(segments=t.segments, count=t.count + k),) + current[same + 1:]
                e = est.evaluate(structure, mbs, recompute)
                if isinstance(e, str) or e.iteration_time_s > best.iteration_time_s * (1 + _TIE):
                    continue
                if best_round is None or e.iteration_time_s < best_round.iteration_time_s:
                    best_round, improved = e, structure
        if improved is None:
            break
        best, current = best_round, improved
        out.append(improved)
    return out
