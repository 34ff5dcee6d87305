"""The search space: tensor-parallel options, replica templates made of island segments, the
balanced layer split, the micro-batch allocation and turning a choice into a Plan."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_het.cluster import ClusterSpec, IslandSpec, ModelSpec
from megatron_het.plan.types import Plan, ReplicaPlan, StagePlan

__all__ = [
    "Segment",
    "Template",
    "tp_options",
    "balanced_split",
    "balanced_split_options",
    "allocate_micro_batches",
    "island_gpus_used",
    "build_plan",
]


@dataclass(frozen=True, kw_only=True)
class Segment:
    """Consecutive pipeline stages of one replica on one island."""

    island: int  # index into cluster.islands
    tp: int  # tensor-parallel size of each of these stages
    pp: int  # number of stages on this island


@dataclass(frozen=True, kw_only=True)
class Template:
    """``count`` identical replicas, each the pipeline formed by ``segments`` in order."""

    segments: tuple[Segment, ...]  # pipeline order; one island may appear once
    count: int  # number of replicas built from this template

    @property
    def num_stages(self) -> int:
        return sum(s.pp for s in self.segments)

    def stage_islands(self) -> tuple[tuple[int, int], ...]:
        """(island index, tp) per stage in pipeline order."""
        return tuple(itertools.chain.from_iterable([((s.island, s.tp),) * s.pp for s in self.segments]))


def tp_options(model: ModelSpec, island: IslandSpec, *, max_tp: int) -> tuple[int, ...]:
    """Powers of two <= max_tp, <= gpus_per_node and <= the island's GPUs that divide the heads,
    the query groups and the MLP width (Megatron's divisibility rules; TP stays inside a node). An MoE
    model's experts split over TP too, under sequence parallelism (``moe_sequence_parallel``): the
    expert widths and the sequence length must divide as well."""
    limit = min(max_tp, island.gpus_per_node, island.num_gpus)
    widths = [model.num_attention_heads, model.num_query_groups, model.ffn_hidden_size]
    if model.is_moe:
        widths += [model.moe_ffn_hidden_size, model.moe_shared_expert_intermediate_size or 0, model.seq_length]
    out, t = [], 1
    while t <= limit:
        if not any(w % t for w in widths):
            out.append(t)
        t *= 2
    return tuple(out)


def balanced_split(num_layers: int, per_layer: Sequence[float], fixed: Sequence[float],
                   caps: Sequence[int]) -> tuple[int, ...] | None:
    """Layer counts minimising the slowest stage ``fixed[j] + n[j] * per_layer[j]`` with
    ``1 <= n[j] <= caps[j]`` (memory) and ``sum(n) == num_layers``; None if the caps cannot hold it."""
    found = balanced_split_options(num_layers, [[(f, t, c)] for f, t, c in zip(fixed, per_layer, caps)])
    return None if found is None else found[0]


def balanced_split_options(num_layers: int, options: Sequence[Sequence[tuple[float, float, int]]]
                           ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Min-max layer split where stage j runs ``n`` layers with the first of its ``options[j]``
    rows ``(fixed, per_layer, cap)`` whose cap holds ``n`` (rows ordered fastest first, e.g.
    without then with recompute). Returns the counts and each stage's row index, or None if no
    row holds the layers.

    Greedy and exact: every stage's time is non-decreasing in its layer count, so starting every
    stage at one layer and handing out the remaining layers one at a time to the stage whose time
    with one more layer is smallest reaches the smallest achievable maximum. O((L - p) log p),
    which matters at hundreds of stages and thousands of evaluations.
    """
    p = len(options)
    most = [min(opts[0][2] if len(opts) == 1 else max(c for _, _, c in opts), num_layers) for opts in options]
    if p > num_layers or any(m < 1 for m in most) or sum(most) < num_layers:
        return None

    def time(opts: Sequence[tuple[float, float, int]], n: int) -> float:
        for f, t, cap in opts:
            if n <= cap:
                return f + n * t
        raise AssertionError("unreachable: n <= most[j]")

    n = [1] * p
    heap = [(opts[0][0] + 2 * opts[0][1] if opts[0][2] >= 2 else time(opts, 2), j)  # time() inline, as below
            for j, opts in enumerate(options) if most[j] > 1]
    heapq.heapify(heap)
    heappop, heapreplace = heapq.heappop, heapq.heapreplace
    for _ in range(num_layers - p):
        j = heap[0][1]  # non-empty: the caps hold num_layers (checked above)
        k = n[j] = n[j] + 1
        if k < most[j]:
            # time(options[j], k + 1) inline while the first row holds it (the common case); the
            # (time, stage) entries are distinct, so replacing the top pops in the same order
            f, t, cap = options[j][0]
            heapreplace(heap, (f + (k + 1) * t if k < cap else time(options[j], k + 1), j))
        else:
            heappop(heap)
    rows = []
    for nj, opts in zip(n, options):  # each stage's first row that holds its layers (one does: n <= most)
        k = 0
        while nj > opts[k][2]:
            k += 1
        rows.append(k)
    return tuple(n), tuple(rows)


def allocate_micro_batches(total: int, groups: Sequence[tuple[int, float, float]]) -> tuple[list[tuple[int, int]], float] | None:
    """Split ``total`` micro-batches over replica groups minimising the slowest pipeline.

    ``groups`` holds (replicas, A, C): a replica of the group with m micro-batches takes
    ``A + (m - 1) * C``. Returns, per group, (m, replicas that get m) with the rest getting m - 1,
    and the resulting slowest time; None when there are fewer micro-batches than replicas.
    """
    replicas = sum(n for n, _, _ in groups)
    if total < replicas:
        return None

    def m_at(limit: float, a: float, c: float) -> int:
        return max(1, math.floor((limit - a) / c + 1e-12) + 1) if c > 0 else total

    lo = max(a for _, a, _ in groups)
    hi = max(a + (total - 1) * c for _, a, c in groups)
    if len(groups) == 1:  # one layout: an even split, no search needed
        (n, a, c), = groups
        lo = hi = a + (-(-total // n) - 1) * c
    for _ in range(80):
        if hi - lo <= 1e-12 * hi:
            break
        mid = (lo + hi) / 2
        # sum(n * m_at(mid, a, c)) inline: the bisection's 80 rounds over every group dominate this function
        held = 0
        for n, a, c in groups:
            held += n * (max(1, math.floor((mid - a) / c + 1e-12) + 1) if c > 0 else total)
        if held >= total:
            hi = mid
        else:
            lo = mid
    ms = [min(m_at(hi, a, c), total) for _, a, c in groups]
    high = [n for n, _, _ in groups]  # replicas of each group at ms[g]; the rest at ms[g] - 1
    excess = sum(n * m for (n, _, _), m in zip(groups, ms)) - total
    order = sorted(range(len(groups)), key=lambda g: -(groups[g][1] + (ms[g] - 1) * groups[g][2]))
    for g in order:
        if excess <= 0:
            break
        if ms[g] <= 1:
            continue
        take = min(excess, high[g])
        high[g] -= take
        excess -= take
        if high[g] == 0:
            ms[g], high[g] = ms[g] - 1, groups[g][0]
    if excess > 0:  # cannot happen when total >= replicas; guard against float corner cases
        return None
    worst = max(a + ((m if h else m - 1) - 1) * c for (_, a, c), m, h in zip(groups, ms, high))
    return list(zip(ms, high)), worst


def island_gpus_used(templates: Sequence[Template], num_islands: int) -> list[int]:
    used = [0] * num_islands
    for t in templates:
        for s in t.segments:
            used[s.island] += t.count * s.tp * s.pp
    return used


def build_plan(cluster: ClusterSpec, templates: Sequence[Template], layer_counts: Sequence[Sequence[int]],
               micro_batches: Sequence[tuple[int, int]], *, micro_batch_size: int, global_batch_size: int,
               recompute: bool, distributed_optimizer: bool,
               stage_recompute: Sequence[Sequence[bool]] | None = None, precision: str = "bf16",
               attention: str | None = None, sequence_parallel: bool = False, expert_parallel: int = 1) -> Plan:
    """Turn a search point into a Plan.

    ``stage_recompute`` (per template, per stage) overrides ``recompute`` stage by stage; ``precision``
    is the one the point was priced at (Plan.precision).

    Ranks: island by island in cluster-file order, only the GPUs used (so ranks are exactly
    0..N-1); inside an island, replica by replica and stage by stage, each stage's TP ranks
    consecutive.
    """
    used = island_gpus_used(templates, len(cluster.islands))
    offset = [sum(used[:i]) for i in range(len(used))]
    nxt = list(offset)
    replicas = []
    if stage_recompute is None:
        stage_recompute = [[recompute] * len(counts) for counts in layer_counts]
    for t, counts, (m, high), flags in zip(templates, layer_counts, micro_batches, stage_recompute):
        for copy in range(t.count):
            stages, first = [], 0
            for (isl, tp), n, rc in zip(t.stage_islands(), counts, flags):
                island = cluster.islands[isl]
                stages.append(StagePlan(island=island.name, device_type=island.device.name,
                                        ranks=tuple(range(nxt[isl], nxt[isl] + tp)), layers=(first, first + n),
                                        recompute=rc))
                nxt[isl] += tp
                first += n
            replicas.append(ReplicaPlan(stages=tuple(stages), num_micro_batches=m if copy < high else m - 1))
    return Plan(replicas=tuple(replicas), micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
                use_distributed_optimizer=distributed_optimizer and len(replicas) > 1, precision=precision,
                attention=attention, sequence_parallel=sequence_parallel, expert_parallel=expert_parallel)


def moe_sequence_parallel(model: ModelSpec) -> bool:
    """megatron-core trains MoE layers under TP only with sequence parallelism: the planner's MoE plans have it."""
    return model.is_moe
