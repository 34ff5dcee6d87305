"""Local search around the best closed-form candidates: the fast search prunes TP and PP choices
per island; hill-climbing over one-step changes recovers most of what the pruning missed."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace

from megatron_het.cluster import ClusterSpec
from megatron_het.planner.estimate import Estimate
from megatron_het.planner.space import Segment, Template, island_gpus_used

__all__ = ["neighbours", "hill_climb"]

Structure = tuple[Template, ...]


def _free(structure: Structure, cluster: ClusterSpec, ti: int, si: int | None) -> list[int]:
    """GPUs left per island when template ti's segment si (all of ti when si is None) is removed."""
    used = island_gpus_used(structure, len(cluster.islands))
    t = structure[ti]
    for k, s in enumerate(t.segments):
        if si is None or k == si:
            used[s.island] -= t.count * s.tp * s.pp
    return [i.num_gpus - u for i, u in zip(cluster.islands, used)]


def neighbours(structure: Structure, cluster: ClusterSpec, *, tps: Mapping[int, Sequence[int]], num_layers: int,
               max_replicas: int) -> Iterator[Structure]:
    """Structures one change away: a segment's TP or PP, a template's replica count, the order
    of two adjacent segments, dropping a segment or a template."""
    for ti, t in enumerate(structure):
        def put(new: Template) -> Structure:
            return structure[:ti] + (new,) + structure[ti + 1:]

        for si, seg in enumerate(t.segments):
            free = _free(structure, cluster, ti, si)[seg.island]
            options = set()
            for tp in tps[seg.island]:
                top = free // (t.count * tp)
                for pp in (top, seg.pp * seg.tp // tp, seg.pp - 1, seg.pp + 1):
                    if 1 <= pp <= min(top, num_layers):
                        options.add((tp, pp))
            options.discard((seg.tp, seg.pp))
            for tp, pp in sorted(options):
                segs = t.segments[:si] + (Segment(island=seg.island, tp=tp, pp=pp),) + t.segments[si + 1:]
                if sum(s.pp for s in segs) <= num_layers:
                    yield put(replace(t, segments=segs))
            if len(t.segments) > 1:
                yield put(replace(t, segments=t.segments[:si] + t.segments[si + 1:]))
            if si + 1 < len(t.segments):
                segs = list(t.segments)
                segs[si], segs[si + 1] = segs[si + 1], segs[si]
                yield put(replace(t, segments=tuple(segs)))
        total = sum(x.count for x in structure)
        for count in (t.count - 1, t.count + 1):
            if count < 1 or total - t.count + count > max_replicas:
                continue
            free = _free(structure, cluster, ti, None)
            segs = []
            for s in t.segments:
                pp = min(s.pp, free[s.island] // (count * s.tp))
                if pp < 1:
                    break
                free[s.island] -= count * s.tp * pp
                segs.append(replace(s, pp=pp))
            else:
                yield put(Template(segments=tuple(segs), count=count))
        if len(structure) > 1:
            yield structure[:ti] + structure[ti + 1:]


def hill_climb(start: Estimate, evaluate: Callable[[Structure, int, bool], Estimate | None], cluster: ClusterSpec, *,
               tps: Mapping[int, Sequence[int]], num_layers: int, global_batch_size: int,
               micro_batch_sizes: Sequence[int], recompute_options: Sequence[bool], max_steps: int = 25,
               key: Callable[[Estimate], float] = lambda e: e.iteration_time_s) -> Estimate:
    """First-improvement hill climbing on the closed-form estimate ``key`` (default: under 1F1B), over
    structure changes and the (micro-batch size, recompute) pair."""
    best = start
    for _ in range(max_steps):
        improved = False
        pairs = [(b, rc) for b in micro_batch_sizes for rc in recompute_options
                 if (b, rc) != (best.micro_batch_size, best.recompute)]
        moves = [(best.templates, b, rc) for b, rc in pairs]
        moves += [(s, best.micro_batch_size, best.recompute)
                  for s in neighbours(best.templates, cluster, tps=tps, num_layers=num_layers,
                                      max_replicas=global_batch_size // best.micro_batch_size)]
        for structure, b, rc in moves:
            e = evaluate(structure, b, rc)
            if e is not None and key(e) < key(best) * (1 - 1e-9):
                best, improved = e, True
                break
        if not improved:
            break
    return best
