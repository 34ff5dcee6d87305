"""plan_sharded: uneven sharded data parallelism (Cephalo) as a plan family, and its comparison
with the pipeline planner.

Every GPU of the chosen islands becomes one rank running the whole model. For each micro-batch
size cap the search:

1. gives each rank the largest micro-batch size (<= the cap) whose activations fit beside the
   working weights and gradient buffer, without recomputation if possible;
2. splits the global batch: ``batch_policy="speed"`` assigns samples one by one to the rank that
   would finish earliest (min-max of ``samples x seconds per sample``), ``"equal"`` splits evenly;
   each rank's micro-batch size is then the largest allowed divisor of its sample count;
3. splits the training state (fp32 master + Adam moments): ``shard_policy="memory"`` in
   proportion to each rank's free memory after activations (Cephalo's rule); ``"balanced"`` as
   evenly as each rank's free memory allows (water-filling: it minimises the largest shard, which
   is what the padded uneven all-gather/reduce-scatter cost); ``"equal"`` evenly (every rank must
   then hold ``1/N``); ``"auto"`` tries all three. Recomputation is turned on rank by rank,
   largest activation saving first, while the state does not fit;
4. prices the result with ``perf.sharded.predict_sharded_ranks``; the fastest cap wins.

``planner.modes.plan_best`` runs this and the pipeline search (``plan_cluster``) on the same
inputs and keeps the faster.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from megatron_het.cluster import ClusterSpec, ModelSpec
from megatron_het.perf.bounds import check_global_batch_size
from megatron_het.perf.flops import total_parameters
from megatron_het.perf.memory import DEFAULT_OVERHEAD_BYTES
from megatron_het.perf.profile import Profile
from megatron_het.perf.sharded import (
    Precision,
    ShardedPrediction,
    compute_precision,
    predict_sharded_ranks,
    rank_compute_s,
    sharded_rank_memory,
    state_bytes_for,
)
from megatron_het.planner.errors import InfeasibleError
from megatron_het.sharding.layout import proportional_split
from megatron_het.sharding.plan import RankShare, ShardedPlan

__all__ = ["ShardPolicy", "BatchPolicy", "balanced_fractions", "plan_sharded", "predict_sharded"]

ShardPolicy = Literal["auto", "memory", "balanced", "equal"]
BatchPolicy = Literal["speed", "equal"]


@dataclass(frozen=True, kw_only=True)
class _Rank:
    """One GPU as the search sees it."""

    island: str  # island name
    device_type: str  # catalog name
    capacity: int  # bytes


def _ranks(cluster: ClusterSpec, islands: Sequence[str] | None, capacity_bytes: Sequence[int] | None) -> list[_Rank]:
    names = list(cluster.island_names if islands is None else islands)
    unknown = [n for n in names if n not in cluster.island_names]
    if unknown:
        raise InfeasibleError(f"islands: unknown island(s) {unknown}. Fix: use names from {list(cluster.island_names)}")
    count = sum(isl.num_gpus for isl in cluster.islands if isl.name in names)
    if count > MAX_SHARDED_RANKS:  # refuse before listing a million ranks (that alone takes seconds)
        raise InfeasibleError(f"ranks: {count:,} GPUs exceed the sharded planner's bound of {MAX_SHARDED_RANKS:,} "
                              "(a sharded plan lists, shards and prices every rank; beyond it planning takes minutes). "
                              "Fix: use the pipeline planner (plan.py --mode pipeline) or plan for a subset of islands")
    out = [_Rank(island=isl.name, device_type=isl.device.name, capacity=int(isl.device.memory_gib * 2**30))
           for isl in cluster.islands if isl.name in names for _ in range(isl.num_gpus)]
    if capacity_bytes is not None:
        if len(capacity_bytes) != len(out):
            raise InfeasibleError(f"capacity_bytes: has {len(capacity_bytes)} entries for {len(out)} ranks. "
                                  "Fix: pass one capacity per GPU, island by island")
        out = [_Rank(island=r.island, device_type=r.device_type, capacity=int(c)) for r, c in zip(out, capacity_bytes)]
    return out


# Ranks the sharded planner handles (about 10 s at the bound on one core); the largest sharded
# data-parallel runs published use ~16K GPUs.
MAX_SHARDED_RANKS = 1 << 15


def _min_max_split(total: int, seconds_per_sample: Sequence[float]) -> list[int]:
    """Integer samples per rank minimising max(samples x seconds): greedy earliest finish."""
    # Every sample finishing by the water level (total / sum of rates) is in the greedy's first picks: take
    # those by count, then run the greedy for the few left (fewer than one per rank), never one per sample.
    counts = [0] * len(seconds_per_sample)
    if seconds_per_sample and min(seconds_per_sample) > 0:
        level = total / sum(1.0 / t for t in seconds_per_sample) * (1.0 - 1e-12)  # a hair below: rounding safe
        counts = [min(int(level / t), total) for t in seconds_per_sample]
    if sum(counts) > total:  # cannot happen in exact arithmetic; keep the greedy's answer if floats disagree
        counts = [0] * len(seconds_per_sample)
    heap = [((c + 1) * t, i) for i, (c, t) in enumerate(zip(counts, seconds_per_sample))]
    heapq.heapify(heap)
    for _ in range(total - sum(counts)):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, ((counts[i] + 1) * seconds_per_sample[i], i))
    return counts


def balanced_fractions(caps: Sequence[float]) -> list[float]:
    """Fractions as equal as the caps allow (water-filling): ``f_r = min(cap_r, level)``, sum 1.

    Minimises the largest shard, which is what the padded uneven collectives cost; requires
    ``sum(caps) >= 1``.
    """
    if sum(caps) < 1.0 - 1e-12:
        raise ValueError(f"caps: sum to {sum(caps):.6f}, need >= 1 (limit 1). Fix: add memory or lower the state")
    left, out = 1.0, [0.0] * len(caps)
    order = sorted(range(len(caps)), key=lambda i: caps[i])
    for k, i in enumerate(order):
        share = left / (len(caps) - k)
        out[i] = min(caps[i], share)
        left -= out[i]
    return out


def predict_sharded(plan: ShardedPlan, model: ModelSpec, cluster: ClusterSpec, *,
                    profile: Profile | Sequence[Profile] | None = None, precision: Precision | None = None,
                    capacity_bytes: Sequence[int] | None = None,
                    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> ShardedPrediction:
    """Price a ShardedPlan (memory per rank, iteration time) with ``perf.sharded``, at ``precision``
    (default: the plan's own, the precision it was planned at and trains in; "mixed" for a plan
    that records none)."""
    precision = (plan.precision or "mixed") if precision is None else precision
    rs = plan.ranks
    return predict_sharded_ranks(model, cluster, islands=[r.island for r in rs],
                                 micro_batch_sizes=[r.micro_batch_size for r in rs],
                                 num_micro_batches=[r.num_micro_batches for r in rs],
                                 shard_fractions=[r.shard_fraction for r in rs], recompute=[r.recompute for r in rs],
                                 global_batch_size=plan.global_batch_size, precision=precision, profile=profile,
                                 capacity_bytes=capacity_bytes, overhead_bytes=overhead_bytes)


def _try_cap(model: ModelSpec, cluster: ClusterSpec, ranks: list[_Rank], *, cap: int, sizes: list[int],
             global_batch_size: int, recompute_options: Sequence[bool], shard_policy: ShardPolicy,
             batch_policy: BatchPolicy, precision: Precision, profile, overhead: int) -> ShardedPlan | str:
    P = total_parameters(model)

    @functools.cache
    def base(mbs: int, rc: bool) -> int:  # bytes of everything but the state shard
        m = sharded_rank_memory(model, shard_fraction=0.0, micro_batch_size=mbs, recompute=rc, precision=precision,
                                overhead_bytes=overhead, num_parameters=P)
        return m.total_bytes

    @functools.cache
    def island_sample_s(island: str, mbs: int, rc: bool) -> float:  # ranks of one island price alike
        return rank_compute_s(model, cluster.island(island), micro_batch_size=mbs, num_micro_batches=1,
                              recompute=rc, slowdown=cluster.slowdown(island), profile=profile,
                              precision=precision) / mbs

    def per_sample_s(r: _Rank, mbs: int, rc: bool) -> float:
        return island_sample_s(r.island, mbs, rc)

    def fitting_mbs(r: _Rank, limit: int) -> tuple[int, bool] | None:
        """The (micro-batch size <= limit, recompute) that fits and computes a sample fastest."""
        fits = [(per_sample_s(r, mbs, rc), rc, -mbs) for mbs in sizes if mbs <= limit
                for rc in set(recompute_options) if base(mbs, rc) <= r.capacity]
        if not fits:
            return None
        _, rc, neg = min(fits)
        return -neg, rc

    chosen = []
    for i, r in enumerate(ranks):
        fit = fitting_mbs(r, cap)
        if fit is None:
            return (f"rank {i} ({r.device_type}): the working weights, gradient buffer and one micro-batch of "
                    f"{min(sizes)} need {base(min(sizes), max(recompute_options))} bytes, capacity {r.capacity}")
        chosen.append(fit)
    per_sample = [per_sample_s(r, mbs, rc) for r, (mbs, rc) in zip(ranks, chosen)]
    if batch_policy == "speed":
        samples = _min_max_split(global_batch_size, per_sample)
    elif batch_policy == "equal":
        samples = list(proportional_split(global_batch_size, [1.0] * len(ranks)))
    else:
        raise ValueError(f"batch_policy: must be 'speed' or 'equal' (got {batch_policy!r}). Fix: pick one")
    mbs_list, micro, rcs = [], [], []
    for r, (mbs, rc), s in zip(ranks, chosen, samples):
        b = max((d for d in sizes if d <= mbs and s % d == 0), default=None) if s else min(sizes)
        if b is None:
            return f"no allowed micro-batch size <= {mbs} divides a share of {s} samples"
        mbs_list.append(b)
        micro.append(s // b)
        rcs.append(rc and base(b, False) > r.capacity)  # a smaller final size may not need recompute
    state_total = state_bytes_for(precision).state_bytes * P
    free = [r.capacity - base(b, rc) for r, b, rc in zip(ranks, mbs_list, rcs)]
    if shard_policy not in ("memory", "balanced", "equal"):
        raise ValueError(f"shard_policy: must be 'memory', 'balanced' or 'equal' (got {shard_policy!r}). "
                         "Fix: pick one (plan_sharded also takes 'auto')")
    need_each = state_total / len(ranks) if shard_policy == "equal" else 0.0
    # Recompute where it frees the most memory, until the state fits (every rank's equal share,
    # or the whole state somewhere).
    order = sorted(range(len(ranks)), key=lambda i: base(mbs_list[i], rcs[i]) - base(mbs_list[i], True),
                   reverse=True)
    for i in order:
        short = (any(f < need_each for f in free) if shard_policy == "equal"
                 else sum(max(f, 0) for f in free) < state_total)
        if not short:
            break
        if not rcs[i] and True in recompute_options and (shard_policy != "equal" or free[i] < need_each):
            rcs[i] = True
            free[i] = ranks[i].capacity - base(mbs_list[i], True)
    room = sum(max(f, 0) for f in free)
    if shard_policy == "equal":
        for i, f in enumerate(free):
            if need_each > f:
                return (f"rank {i} ({ranks[i].device_type}): an equal state shard needs {int(need_each)} bytes, "
                        f"{max(int(f), 0)} are free at micro-batch cap {cap}")
        fractions = [1.0 / len(ranks)] * len(ranks)
    elif room < state_total:
        return (f"training state {state_total} bytes exceeds the free memory of all ranks together, {room} "
                f"bytes, at micro-batch cap {cap}")
    elif shard_policy == "memory":
        fractions = [max(f, 0) / room for f in free]
    else:
        # a hair under each cap: the shard's byte count is rounded up
        fractions = balanced_fractions([max(f, 0) * (1 - 1e-9) / state_total for f in free])
    return ShardedPlan(ranks=tuple(RankShare(rank=i, island=r.island, device_type=r.device_type,
                                             micro_batch_size=mbs_list[i], num_micro_batches=micro[i],
                                             shard_fraction=fractions[i], recompute=rcs[i])
                                   for i, r in enumerate(ranks)), global_batch_size=global_batch_size)


def plan_sharded(model: ModelSpec, cluster: ClusterSpec, *, global_batch_size: int,
                 micro_batch_sizes: Sequence[int] = (1, 2, 4, 8), recompute_options: Sequence[bool] = (False, True),
                 shard_policy: ShardPolicy = "auto", batch_policy: BatchPolicy = "speed",
                 profile: Profile | Sequence[Profile] | None = None, islands: Sequence[str] | None = None,
                 precision: Precision = "mixed", capacity_bytes: Sequence[int] | None = None,
                 overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> ShardedPlan:
    """The fastest uneven sharded plan for ``model`` on ``cluster`` with ``predicted`` attached.

    ``capacity_bytes`` (one per GPU, island by island) overrides the catalog's device memory, e.g.
    for an emulated cluster. Raises InfeasibleError naming the failed constraint with numbers.
    """
    if model.is_moe:
        raise InfeasibleError("the sharded data-parallel strategy does not build mixture-of-experts layers yet "
                              f"({model.num_experts} experts); MoE models run in the pipeline runtime (docs/moe.md). "
                              "Fix: use --mode pipeline")
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise InfeasibleError(f"global_batch_size: must be an integer >= 1 (got {global_batch_size!r}). "
                              "Fix: pass a positive global batch size in sequences")
    check_global_batch_size(global_batch_size)
    sizes = sorted({int(b) for b in micro_batch_sizes if int(b) >= 1})
    if not sizes or not recompute_options:
        raise InfeasibleError(f"micro_batch_sizes/recompute_options: need at least one positive size and one "
                              f"option (got {tuple(micro_batch_sizes)}, {tuple(recompute_options)}). "
                              "Fix: pass e.g. (1, 2, 4) and (False, True)")
    ranks = _ranks(cluster, islands, capacity_bytes)  # refuses more than MAX_SHARDED_RANKS
    best: tuple[float, ShardedPlan, ShardedPrediction] | None = None
    reasons: list[str] = []
    policies = ("balanced", "memory", "equal") if shard_policy == "auto" else (shard_policy,)
    chosen_policy = shard_policy
    for policy in policies:
        for cap in sizes:
            got = _try_cap(model, cluster, ranks, cap=cap, sizes=sizes, global_batch_size=global_batch_size,
                           recompute_options=recompute_options, shard_policy=policy, batch_policy=batch_policy,
                           precision=precision, profile=profile, overhead=overhead_bytes)
            if isinstance(got, str):
                reasons.append(f"{policy}: {got}")
                continue
            pred = predict_sharded(got, model, cluster, profile=profile, precision=precision,
                                   capacity_bytes=[r.capacity for r in ranks], overhead_bytes=overhead_bytes)
            if best is None or pred.iteration_time_s < best[0]:
                best, chosen_policy = (pred.iteration_time_s, got, pred), policy
    if best is None:
        raise InfeasibleError(
            f"no sharded plan ({shard_policy} shards) fits {model.name or 'the model'} on {len(ranks)} GPUs: "
            + "; ".join(dict.fromkeys(reasons))
            + (". Fix: use shard_policy='memory'" if shard_policy == "equal" else
               ". Fix: add GPUs or memory, enable recompute, or use the pipeline planner (plan_cluster)"),
            reasons=tuple(dict.fromkeys(reasons)))
    _, plan, pred = best
    predicted = dict(pred.to_json_dict(), shard_policy=chosen_policy, batch_policy=batch_policy)
    return ShardedPlan(ranks=plan.ranks, global_batch_size=plan.global_batch_size,
                       precision=compute_precision(precision), predicted=predicted)  # "mixed" is recorded as bf16
