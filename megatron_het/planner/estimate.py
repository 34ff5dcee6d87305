"""Fast closed-form estimate of a search point, used to rank candidates before the full
prediction (which simulates every pipeline) is run on the best few.

A replica of stage times ``tau_j = f_j + b_j`` running 1F1B over m micro-batches takes
``sum(tau) + sum(hops both ways) + (m - 1) * T`` where T is the steady-state period
(:func:`pipeline_period`): not just ``max(tau)``, because 1F1B keeps only ``p - j`` micro-batches in
flight on stage j, so a run of stages plus the transfers between them forms a loop that the
pipeline cannot go around faster than its total time over its length. Gradient reduction and the
optimizer step are priced as in :func:`megatron_het.perf.predict`.

ZB-H1 (split backward, W deferred into the cool-down) is priced beside it, as a second key the
search ranks by (``Estimate.zb_iteration_time_s``): without it, deep pipelines that only ZB-H1 makes
fast are never predicted in full.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_het.cluster import ClusterSpec, ModelSpec
from megatron_het.perf.calibrate import with_measured_links
from megatron_het.perf.comm import (
    activation_message_bytes,
    distributed_optimizer_share,
    dp_gradient_reduction,
    p2p_time,
)
from megatron_het.perf.flops import stage_parameters, word_embedding_parameters_per_rank
from megatron_het.perf.memory import device_capacity_bytes, state_bytes
from megatron_het.perf.predict import (
    StageCost,
    backward_split_shares,
    bucket_parameters,
    check_island_profiles,
    optimizer_step_s,
    overlapped_reduction_tail_s,
    stage_gradient_chunks,
)
from megatron_het.perf.profile import Profile
from megatron_het.plan.types import fused_attention
from megatron_het.planner.parallelizer import IntraConfig, LayerSlice, MegatronParallelizer, Parallelizer, memory_lines
from megatron_het.planner.space import Template, allocate_micro_batches, balanced_split_options

__all__ = ["Estimate", "Estimator", "pipeline_period"]


def pipeline_period(taus: Sequence[float], hops: Sequence[float]) -> float:
    """Steady-state 1F1B period of stages ``taus`` (forward + backward per micro-batch) with
    ``hops[j]`` = forward + backward transfer time between stages j and j+1.

    In steady state stage i runs F(k) after B(k - (p - i)) and B(k) after F(k + p - i - 1); the
    dependency graph then has one loop per run of stages i..l (forward down the run, backward
    back up) that holds l - i + 1 micro-batches. The period is the largest loop time over its
    length, ``max over i <= l of (sum tau[i..l] + sum hops[i..l-1]) / (l - i + 1)``; the single
    stages give ``max(tau)``. It matches the simulator to ~1% where ``max(tau)`` was up to 20% low
    when transfers are slow (e.g. across islands over 25 Gb/s).
    """
    best = max(taus)
    if not any(hops):  # no transfers: loops cannot beat their slowest stage
        return best
    p = len(taus)
    if 8 < p <= 24:  # the prefix-sum form below, element for element, without numpy's per-call overhead
        t = [0.0, *itertools.accumulate(taus)]  # the same sequential sums as np.cumsum
        h = [0.0, *itertools.accumulate(hops)]
        top = 0.0
        for i in range(p):
            ti, hi = t[i], h[i]
            for length, l in enumerate(range(i, p), start=1):
                run = (t[l + 1] - ti + h[l] - hi) / length
                if run > top:
                    top = run
        return max(best, top)
    if p > 8:  # every run at once: sum over i..l = T[l+1] - T[i] + H[l] - H[i] from prefix sums
        t = np.concatenate(([0.0], np.cumsum(taus)))
        h = np.concatenate(([0.0], np.cumsum(hops)))
        length = np.arange(p)[None, :] - np.arange(p)[:, None] + 1
        runs = (t[None, 1:] - t[:-1, None] + h[None, :] - h[:, None]) / np.where(length > 0, length, 1)
        return max(best, float(np.where(length > 0, runs, 0.0).max()))
    for i in range(p - 1):
        total = taus[i]
        for length, l in enumerate(range(i + 1, p), start=2):
            total += taus[l] + hops[l - 1]
            if total > best * length:
                best = total / length
    return best


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """One fully specified search point and its closed-form iteration time."""

    templates: tuple[Template, ...]  # replica templates with counts
    layer_counts: tuple[tuple[int, ...], ...]  # per template, layers per stage
    micro_batches: tuple[tuple[int, int], ...]  # per template, (m, replicas getting m; the rest m - 1)
    micro_batch_size: int  # sequences per micro-batch
    recompute: bool  # recompute allowed: stages recompute where memory needs it (else none do)
    stage_recompute: tuple[tuple[bool, ...], ...]  # per template, per stage: full recomputation on
    iteration_time_s: float  # closed-form estimate under 1F1B
    # The same under ZB-H1: per replica, the cool-down bubble shrinks by twice the weight-gradient
    # (W) time of all stages but the one with the largest W (for p equal stages, 1F1B's bubble
    # (p - 1)(F + B + W) becomes (p - 1)(F + B - W), Qi et al. 2023), and the steady period's
    # transfer loops hold F and B only; on the 1F1B estimate's micro-batch split. Its gradient
    # reduction is not hidden behind other stages' cool-down: the deferred Ws end every stage late.
    zb_iteration_time_s: float = float("inf")


class Estimator:
    """Prices search points; holds per-search caches (one instance per plan_cluster call)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, *, global_batch_size: int,
                 profile: Profile | Sequence[Profile] | None, distributed_optimizer: bool,
                 overlap_grad_reduce: bool = False, parallelizer: Parallelizer | None = None,
                 max_tp: int = 8, precision: str = "bf16", fill_free: bool = False,
                 attention: str | None = None, expert_parallel: int = 1) -> None:
        self.model = model
        # an MoE plan's EP (Plan.expert_parallel; expert-TP = TP): memory and parameters hold num_experts / EP
        # experts per rank, and a point's replicas form expert domains of EP identical replicas of one
        # template, with equal micro-batches (plan/experts.py), so templates come in multiples of EP
        self.expert_parallel = expert_parallel
        # What-if only (bench/zero_bubble_whatif.py): price every replica as m x its steady period, a
        # schedule with no pipeline fill at all, which no schedule the runtime runs achieves.
        self.fill_free = fill_free
        check_island_profiles(profile, cluster, (i.name for i in cluster.islands))
        self.cluster = with_measured_links(cluster, profile)  # the same links predict() prices
        self.global_batch_size = global_batch_size
        self.profile = profile
        self.distributed_optimizer = distributed_optimizer
        self.overlap_grad_reduce = overlap_grad_reduce  # price stage 0's reduction as megatron's bucketed overlap
        self.precision = precision  # what the plans train in (build_plan records it in Plan.precision)
        self.attention = attention  # the attention kernel priced and recorded (Plan.attention); None: default
        self._state_bytes = state_bytes(self.precision)[:2]  # (weight, gradient) bytes per parameter
        self._costs: dict[tuple[int, int, int, bool], StageCost] = {}
        self._mem: dict[tuple[object, ...], tuple[int, int, int, int]] = {}
        self._hops: dict[tuple[object, ...], float] = {}
        self._red: dict[tuple[object, ...], tuple[float, float]] = {}
        self._sync: dict[tuple[object, ...], tuple[float, float]] = {}  # grad_sync's line per placement
        self._opt_rate: dict[int, float] = {}  # optimizer seconds per parameter per island
        self._no_cap_hit: dict[tuple[object, ...], Estimate] = {}  # no-recompute estimates no memory cap bound
        self._params: dict[tuple[object, ...], int] = {}
        self._floors: dict[tuple[int, int], tuple[float, dict[int, float]]] = {}  # lower_bound's per-island rates
        self._rows: dict[tuple[object, ...], list[tuple[float, float, int]]] = {}
        self._by_tp: dict[tuple[object, ...], dict[int, dict[bool, IntraConfig]]] = {}  # rows' configs per slice
        self._options: dict[tuple[object, ...], list[list[tuple[float, float, int]]]] = {}
        self._capacity = [device_capacity_bytes(i.device) for i in cluster.islands]
        # How a slice runs inside an island (TP, recompute) and what it costs: the plug-in point.
        self.parallelizer: Parallelizer = parallelizer if parallelizer is not None else MegatronParallelizer(
            model, self.cluster, max_tp=max_tp, profile=profile, distributed_optimizer=distributed_optimizer,
            precision=precision, attention=attention, expert_parallel=expert_parallel)
        self._candidates: dict[tuple[int, LayerSlice], Sequence[IntraConfig]] = {}
        self._tps: dict[int, tuple[int, ...]] = {}
        # W's share of a fused backward per island (measured split, else half): ZB-H1's estimate
        self._w_share = [backward_split_shares(profile, i.device.name, i.name)[1] for i in cluster.islands]

    def configs(self, isl: int, slice_: LayerSlice) -> Sequence[IntraConfig]:
        """The parallelizer's candidates for ``slice_`` on island ``isl`` within device memory (cached)."""
        key = (isl, slice_)
        if key not in self._candidates:
            self._candidates[key] = tuple(self.parallelizer.candidates(slice_, isl, self._capacity[isl]))
        return self._candidates[key]

    def tp_sizes(self, isl: int) -> tuple[int, ...]:
        """TP sizes the parallelizer offers on island ``isl`` (asked with a one-layer slice and no
        memory limit, so that memory never hides a size the search may combine with more stages)."""
        if isl not in self._tps:
            probe = LayerSlice(num_layers=1, is_first=False, is_last=False, micro_batch_size=1, in_flight=1,
                               data_parallel=1, recompute_allowed=True)
            found = self.parallelizer.candidates(probe, isl, 2**62)
            self._tps[isl] = tuple(sorted({c.tp for c in found}))
        return self._tps[isl]

    def _layer_floor(self, isl: int, mbs: int) -> tuple[float, dict[int, float]]:
        """Island ``isl`` at micro-batch size ``mbs``, over every TP size offered without a memory
        limit or recompute: the least GPU-seconds of one layer's forward and backward of one
        micro-batch, and per TP size the least time one layer adds to a micro-batch's trip through
        the pipeline under either schedule (forward, plus the part of the backward ZB-H1 keeps on
        the critical path: B - W >= bwd * (1 - 2 * W share), never below zero). Cached."""
        key = (isl, mbs)
        if key not in self._floors:
            probe = LayerSlice(num_layers=1, is_first=False, is_last=False, micro_batch_size=mbs, in_flight=1,
                               data_parallel=1, recompute_allowed=False)
            found = [c for c in self.parallelizer.candidates(probe, isl, 2**62) if not c.recompute]
            keep = max(0.0, 1.0 - 2.0 * self._w_share[isl])
            trip: dict[int, float] = {}
            for c in found:
                t = c.cost.layer_forward_s + keep * c.cost.layer_backward_s
                trip[c.tp] = min(trip.get(c.tp, t), t)
            rate = min((c.tp * (c.cost.layer_forward_s + c.cost.layer_backward_s) for c in found), default=0.0)
            self._floors[key] = (rate, trip)
        return self._floors[key]

    def lower_bound(self, templates: Sequence[Template], mbs: int) -> float:
        """No plan of ``templates`` iterates faster under 1F1B or ZB-H1 (either estimate), whatever the
        layer split: a replica of template t running m micro-batches takes at least
        ``fill_t + (m - 1) * tau_t``, where tau_t = L / (its GPUs' layer rate) is its period with
        perfectly balanced stages and fill_t its first micro-batch's trip, at least one layer per
        stage at that stage's per-layer trip time and the rest at the fastest stage's; micro-batches
        are spread to equalise that (real-valued, so a bound). Bubble shape, transfers, reduction,
        optimizer, embedding and output are left out."""
        L = self.model.num_layers
        total_mb = self.global_batch_size // mbs
        num, den, fills = float(total_mb), 0.0, 0.0
        for t in templates:
            capacity, fill, least, stages = 0.0, 0.0, math.inf, 0
            for s in t.segments:
                rate, trip = self._layer_floor(s.island, mbs)
                capacity += s.tp * s.pp / rate if rate > 0 else math.inf
                step = trip.get(s.tp, 0.0)
                fill += s.pp * step  # every stage holds at least one layer
                least = min(least, step)
                stages += s.pp
            tau = L / capacity
            if tau <= 0:
                return 0.0
            fill += max(0, L - stages) * least  # the other layers at best on the fastest stage
            if self.fill_free:
                fill = tau
            num += t.count * (fill / tau - 1.0)
            den += t.count / tau
            fills = max(fills, fill)
        return max(fills, num / den)

    def cost(self, isl: int, tp: int, mbs: int, recompute: bool) -> StageCost:
        """The parallelizer's cost of a stage that ``rows`` offered (rows fills the cache)."""
        return self._costs[(isl, tp, mbs, recompute)]

    def memory_line(self, isl: int, tp: int, mbs: int, recompute: bool, *, first: bool, last: bool,
                    in_flight: int, dp: int) -> tuple[int, int]:
        """(bytes with 1 layer, bytes per extra layer) on one rank of such a stage."""
        shard = dp if self.distributed_optimizer and dp > 1 else 1
        key = (isl, tp, mbs, recompute, first, last, in_flight)
        if key not in self._mem:
            # Unsharded lines, optimizer kept apart so one entry serves every replica count.
            args = dict(is_first=first, is_last=last, micro_batch_size=mbs, microbatches_in_flight=in_flight,
                        tp=tp, recompute="full" if recompute else "none", distributed_optimizer=False,
                        precision=self.precision, ep=self.expert_parallel,
                        **({} if self.attention is None else {"flash_attention": fused_attention(self.attention)}))
            self._mem[key] = memory_lines(self.model, num_layers=1, **args)
        rest, opt, rest_slope, opt_slope = self._mem[key]
        return rest + -(-opt // shard), rest_slope + opt_slope / shard

    def hop(self, a: tuple[int, int], b: tuple[int, int], mbs: int) -> float:
        key = (a, b, mbs)
        if key not in self._hops:
            (ia, ta), (ib, tb) = a, b
            ca, cb = self.cluster.islands[ia], self.cluster.islands[ib]
            nbytes = activation_message_bytes(self.model, micro_batch_size=mbs, tp=ta)
            same = ia == ib and (ca.nodes == 1 or ta + tb <= ca.gpus_per_node)
            self._hops[key] = p2p_time(nbytes, self.cluster, src=ca.name, dst=cb.name, same_node=same)
        return self._hops[key]

    def reduction(self, counts: tuple[tuple[int, int], ...], nbytes: float, ranks_per_node: int = 1) -> float:
        """dp_gradient_reduction (an all-reduce) among replicas placed ``counts`` ((island, replicas),
        ...), ``ranks_per_node`` of them sharing a node; it is affine in bytes, so two evaluations per
        placement serve every size."""
        if sum(n for _, n in counts) <= 1:
            return 0.0
        key = (counts, ranks_per_node)
        if key not in self._red:
            names = [self.cluster.islands[i].name for i, n in counts for _ in range(n)]
            t0 = dp_gradient_reduction(0.0, self.cluster, replica_islands=names, ranks_per_node=ranks_per_node).total_s
            t1 = dp_gradient_reduction(1e9, self.cluster, replica_islands=names, ranks_per_node=ranks_per_node).total_s
            self._red[key] = (t0, (t1 - t0) / 1e9)
        t0, slope = self._red[key]
        return t0 + slope * nbytes

    def grad_sync(self, counts: tuple[tuple[int, int], ...], params: int, *, replicas: int,
                  ranks_per_node: int = 1) -> float:
        """A stage's gradient synchronisation over ``params`` parameters, as perf.predict prices it:
        with the distributed optimizer a reduce-scatter of the gradients (half an all-reduce) plus
        the updated weights' all-gather (the other half, hidden with overlap_grad_reduce); without it
        an all-reduce of the gradients. Affine in ``params`` for a placement: cached per placement."""
        key = (counts, replicas, ranks_per_node)
        line = self._sync.get(key)
        if line is None:
            at0 = self._grad_sync(counts, 0, replicas, ranks_per_node)
            line = self._sync[key] = (at0, self._grad_sync(counts, 1, replicas, ranks_per_node) - at0)
        return line[0] + line[1] * params

    def _grad_sync(self, counts: tuple[tuple[int, int], ...], params: int, replicas: int, ranks_per_node: int
                   ) -> float:
        param_bytes, grad_bytes = self._state_bytes
        if self.distributed_optimizer and replicas > 1:
            names = [self.cluster.islands[i].name for i, n in counts for _ in range(n)]
            share = distributed_optimizer_share(self.cluster, replica_islands=names)  # 0.5, or 1 bridged sharded
            rs = share * self.reduction(counts, grad_bytes * params, ranks_per_node)
            return rs if self.overlap_grad_reduce else rs + share * self.reduction(counts, param_bytes * params,
                                                                                    ranks_per_node)
        return self.reduction(counts, grad_bytes * params, ranks_per_node)

    def optimizer_s(self, isl: int, params: int) -> float:
        """One optimizer step over ``params`` parameters on a rank of island ``isl`` (perf.predict's
        optimizer_step_s, linear in the parameters, with the island's slowdown): rate cached."""
        rate = self._opt_rate.get(isl)
        if rate is None:
            island = self.cluster.islands[isl]
            rate = self._opt_rate[isl] = self.cluster.slowdown(island.name) * optimizer_step_s(
                island.device, 1_000_000, profile=self.profile, precision=self.precision, island=island.name) / 1_000_000
        return rate * params

    def ranks_per_node(self, isl: int, tp: int, pp: int, count: int) -> int:
        """Replicas of a template whose copies of one stage share a node of island ``isl`` (ranks are
        placed replica by replica, each taking tp * pp consecutive ranks of the island)."""
        island = self.cluster.islands[isl]
        return max(1, min(count, island.gpus_per_node // (tp * pp))) if island.nodes > 1 else 1

    def rows(self, isl: int, tp: int, mbs: int, recompute: bool, first: bool, last: bool, in_flight: int,
             dp: int) -> list[tuple[float, float, int]]:
        """A stage's (fixed s, s per layer, layer cap) without recompute and, when allowed, with."""
        key = (isl, tp, mbs, recompute, first, last, in_flight, dp)
        out = self._rows.get(key)
        if out is None:
            # The slice's configurations by TP (the first per TP and recompute wins: fastest first),
            # once per slice: stages of several TP sizes ask for the same slice.
            skey = (isl, mbs, recompute, first, last, in_flight, dp)
            by_tp = self._by_tp.get(skey)
            if by_tp is None:
                slice_ = LayerSlice(num_layers=1, is_first=first, is_last=last, micro_batch_size=mbs,
                                    in_flight=in_flight, data_parallel=dp, recompute_allowed=recompute)
                by_tp = self._by_tp[skey] = {}
                for c in reversed(self.configs(isl, slice_)):
                    by_tp.setdefault(c.tp, {})[c.recompute] = c
            found = by_tp.get(tp, {})
            out = []
            for rc in ((False, True) if recompute else (False,)):
                c = found.get(rc)
                if c is None:  # not offered or not even one layer fits: a row that holds no layer
                    out.append((0.0, 0.0, 0))
                    continue
                self._costs[(isl, tp, mbs, rc)] = c.cost
                spare = self._capacity[isl] - c.memory_bytes
                cap = 1 + int(spare // c.memory_per_layer_bytes) if c.memory_per_layer_bytes > 0 else self.model.num_layers
                cost = c.cost
                out.append(((cost.embedding_forward_s + cost.embedding_backward_s if first else 0.0)
                            + (cost.output_forward_s + cost.output_backward_s if last else 0.0),
                            cost.layer_forward_s + cost.layer_backward_s, cap))
            self._rows[key] = out
        return out

    def params(self, n: int, first: bool, last: bool, tp: int) -> int:
        key = (n, first, last, tp)
        if key not in self._params:
            self._params[key] = stage_parameters(self.model, num_layers=n, is_first=first, is_last=last, tp=tp,
                                                 ep=self.expert_parallel)
        return self._params[key]

    def replica_line(self, template: Template, mbs: int, recompute: bool, *, replicas: int
                     ) -> tuple[float, float, float] | None:
        """(A, T, tail) of one replica of ``template`` among ``replicas``: with m micro-batches it takes
        ``A + (m - 1) T + tail`` (closed form, layers balanced under memory caps), the tail being
        its gradient reduction past its end (peers assumed on the stage's own island) and its
        slowest optimizer step; None if it does not fit."""
        L = self.model.num_layers
        stages = template.stage_islands()
        p = len(stages)
        max_m = self.global_batch_size // mbs - replicas + 1
        if p > L or max_m < 1:
            return None
        options = [self.rows(isl, tp, mbs, recompute, j == 0, j == p - 1, min(p - j, max_m), replicas)
                   for j, (isl, tp) in enumerate(stages)]
        found = balanced_split_options(L, options)
        if found is None:
            return None
        counts, picked = found
        taus = [rows[k][0] + n * rows[k][1] for rows, n, k in zip(options, counts, picked)]
        back = [self.hop(b, a, mbs) for a, b in zip(stages, stages[1:])]  # each transfer's backward leg
        hops = [self.hop(a, b, mbs) + up for a, b, up in zip(stages, stages[1:], back)]
        pp_of: dict[int, int] = {}  # stages of the island's (first) segment
        for seg in template.segments:
            pp_of.setdefault(seg.island, seg.pp)
        shard = replicas if self.distributed_optimizer else 1
        lag = exposed = optimizer = 0.0
        for j, ((isl, tp), n, k) in enumerate(zip(stages, counts, picked)):
            params = self.params(n, j == 0, j == p - 1, tp)
            sync = self.grad_sync(((isl, replicas),), params, replicas=replicas,
                                  ranks_per_node=self.ranks_per_node(isl, tp, pp_of[isl], replicas))
            exposed = max(exposed, sync - lag)
            optimizer = max(optimizer, self.optimizer_s(isl, params // shard))
            if j + 1 < p:
                lag += self._costs[(isl, tp, mbs, k == 1)].backward_s(n, is_first=j == 0, is_last=False) + back[j]
        return sum(taus) + sum(hops), pipeline_period(taus, hops), exposed + optimizer

    def _allocate(self, templates: Sequence[Template], total_mb: int, groups: list[tuple[int, float, float]]
                  ) -> tuple[list[tuple[int, int]], float] | str:
        """allocate_micro_batches, or why not. Under EP the unit is an expert domain (EP replicas of one
        template, equal micro-batches): each template's count and the micro-batches are split in EP."""
        ep = self.expert_parallel
        if ep > 1:
            odd = [t.count for t in templates if t.count % ep]
            if odd or total_mb % ep:
                return (f"expert_parallel {ep}: expert domains are {ep} identical replicas with equal micro-batches, "
                        f"but a template has {odd[0]} replicas" if odd else
                        f"expert_parallel {ep}: {total_mb} micro-batches do not split over domains of {ep} replicas")
            alloc = allocate_micro_batches(total_mb // ep, [(n // ep, a, c) for n, a, c in groups])
            if alloc is None:
                return f"cannot give each of {sum(n for n, _, _ in groups) // ep} expert domains a micro-batch"
            split, worst = alloc
            return [(m, high * ep) for m, high in split], worst
        alloc = allocate_micro_batches(total_mb, groups)
        if alloc is None:
            return f"cannot give each of {sum(n for n, _, _ in groups)} replicas a micro-batch"
        return alloc

    def evaluate(self, templates: Sequence[Template], mbs: int, recompute: bool) -> Estimate | str:
        """The estimate, or a reason string when the point is infeasible.

        With ``recompute`` allowed, a structure whose estimate without it left every stage below its
        memory cap is that same estimate (recompute rows are only ever taken past a cap), returned
        without pricing it again."""
        if recompute:
            same = self._no_cap_hit.get((tuple(templates), mbs))
            if same is not None:
                return same
        L = self.model.num_layers
        cap_hit = False
        total_mb = self.global_batch_size // mbs
        replicas = sum(t.count for t in templates)
        if replicas > total_mb:
            return (f"{replicas} replicas need at least {replicas} micro-batches but global_batch_size "
                    f"{self.global_batch_size} / micro_batch_size {mbs} = {total_mb}")
        max_m = total_mb - replicas + 1
        groups, all_counts, all_flags, all_lags, zb, all_stages = [], [], [], [], [], []
        hop, costs = self.hop, self._costs
        for t in templates:
            stages = t.stage_islands()
            all_stages.append(stages)
            p = len(stages)
            if p > L:
                return f"{p} stages > num_layers {L}"
            # Per stage, the rows (fixed, per layer, cap) without recompute and, when allowed,
            # with it: a stage recomputes only when it holds more layers than fit without.
            okey = (stages, mbs, recompute, max_m, replicas)
            options = self._options.get(okey)
            if options is None:
                options = self._options[okey] = [self.rows(isl, tp, mbs, recompute, j == 0, j == p - 1,
                                                           min(p - j, max_m), replicas)
                                                 for j, (isl, tp) in enumerate(stages)]
            found = balanced_split_options(L, options)
            if found is None:
                names = "+".join(f"{self.cluster.islands[s.island].name}(TP={s.tp},PP={s.pp})" for s in t.segments)
                held = sum(min(max(r[2] for r in rows), L) for rows in options)
                return (f"{names}, micro_batch_size {mbs}, recompute {recompute}: stages hold at most "
                        f"{held} of {L} layers in memory")
            counts, picked = found
            cap_hit = cap_hit or any(n >= rows[0][2] and rows[0][2] < L for n, rows in zip(counts, options))
            all_flags.append(tuple(k == 1 for k in picked))
            taus = [rows[k][0] + n * rows[k][1] for rows, n, k in zip(options, counts, picked)]
            back = [hop(b, a, mbs) for a, b in zip(stages, stages[1:])]  # each transfer's backward leg
            hops = [hop(a, b, mbs) + up for a, b, up in zip(stages, stages[1:], back)]
            # When each stage's last backward ends, relative to the replica's end: stage j
            # finishes before stage 0 by the backward cool-down of stages 0..j-1.
            lag, lags, chunk_rows, ws = 0.0, [], [], []
            for j, ((isl, tp), n, k) in enumerate(zip(stages, counts, picked)):
                c = costs[(isl, tp, mbs, k == 1)]  # self.cost, filled by rows
                lags.append(lag)
                bwd = c.backward_s(n, is_first=j == 0, is_last=j == p - 1)
                chunk_rows.append((c, bwd))
                ws.append(self._w_share[isl] * bwd)
                if j + 1 < p:
                    lag += bwd + back[j]
            all_lags.append((lags, chunk_rows))
            fill = sum(taus) + sum(hops)
            period = pipeline_period(taus, hops)
            groups.append((t.count, period if self.fill_free else fill, period))
            all_counts.append(counts)
            # ZB-H1: the steady state's loops run F and B only (W waits), the cool-down fills with W
            zb_period = max(max(taus), pipeline_period([x - w for x, w in zip(taus, ws)], hops))
            zb.append((zb_period if self.fill_free else fill - 2.0 * (sum(ws) - max(ws)), zb_period))
        alloc = self._allocate(templates, total_mb, groups)
        if isinstance(alloc, str):
            return alloc
        split, pipeline = alloc
        # ZB-H1 on the same micro-batch split (a template's replicas run m or m - 1 of them)
        zb_pipeline = max(max(a, c) + ((m if high else m - 1) - 1) * c for (a, c), (m, high) in zip(zb, split))
        # Reduction peers of a stage: in every template, the stage holding the same first layer.
        # Its reduction starts when the last of them ends its backward (as in perf.predict).
        holders = []
        for t, stages, counts, (m, _), (lags, _), (_, a, c) in zip(templates, all_stages, all_counts, split, all_lags,
                                                                     groups):
            end = a + (m - 1) * c  # this template's slowest replica
            starts = [0]
            for n in counts[:-1]:
                starts.append(starts[-1] + n)
            holders.append((t.count, starts, [isl for isl, _ in stages], [end - lag for lag in lags]))
        reduced = zb_reduced = optimizer = 0.0
        shard = replicas if self.distributed_optimizer else 1
        # A tied word embedding with a multi-stage template: every replica's first stage and the last
        # stage's copy reduce it in one group of their own, after the last of their backwards (perf.predict)
        tied = (not self.model.untie_embeddings_and_output_weights) and any(len(st) > 1 for st in all_stages)
        if tied:
            ends_tps = [(ends[k], stages[k][1], isls[k], cnt)
                        for (cnt, _, isls, ends), stages in zip(holders, all_stages) for k in {0, len(isls) - 1}]
            # holders of different TP sizes: grad_sync's reshard path, every TP rank all-reduces the full buffer
            e_reshard = len({tp for _, tp, _, _ in ends_tps}) > 1
            e_where: dict[int, int] = {}
            for _, tp, isl, cnt in ends_tps:
                e_where[isl] = e_where.get(isl, 0) + cnt * (tp if e_reshard else 1)
            e_start = max(end for end, _, _, _ in ends_tps)
            e_holders = sum(cnt for _, _, _, cnt in ends_tps)
            e_placement = tuple(sorted(e_where.items()))
        for t, stages, counts, (_, rows) in zip(templates, all_stages, all_counts, all_lags):
            first = 0
            # per stage, its replicas sharing a node (one figure per segment)
            rpns = [self.ranks_per_node(seg.island, seg.tp, seg.pp, t.count) for seg in t.segments for _ in range(seg.pp)]
            for j, ((isl, tp), n, rpn) in enumerate(zip(stages, counts, rpns)):
                is_first, is_last = j == 0, j == len(stages) - 1
                params = self.params(n, is_first, is_last, tp)
                embedding = (word_embedding_parameters_per_rank(self.model, tp=tp) if tied and (is_first or is_last)
                             else 0)
                params -= embedding
                where: dict[int, int] = {}
                start = 0.0
                for cnt, starts, isls, ends in holders:
                    k = bisect.bisect_right(starts, first) - 1  # the stage holding layer ``first``
                    where[isls[k]] = where.get(isls[k], 0) + cnt
                    start = max(start, ends[k])
                placement = tuple(sorted(where.items()))
                tail = self.grad_sync(placement, params, replicas=replicas, ranks_per_node=rpn)
                if self.overlap_grad_reduce and is_first and replicas > 1:
                    c, bwd = rows[j]
                    chunks = stage_gradient_chunks(self.model, c, num_layers=n, is_first=True, is_last=is_last, tp=tp,
                                                   tied_elsewhere=embedding > 0)
                    tail = overlapped_reduction_tail_s(
                        chunks, backward_s=bwd, bucket_params=bucket_parameters(replicas),
                        reduce_s=lambda k, placement=placement, rpn=rpn: self.grad_sync(
                            placement, k, replicas=replicas, ranks_per_node=rpn))
                reduced = max(reduced, start + tail)
                zb_reduced = max(zb_reduced, tail)  # ZB-H1: every stage's deferred Ws run to the end
                opt_params = params // shard
                if embedding:
                    e_numel = self.model.vocab_size * self.model.hidden_size if e_reshard else embedding
                    e_tail = self.grad_sync(e_placement, e_numel, replicas=e_holders, ranks_per_node=rpn)
                    # on the same network as the stage's own reductions, after what is left of them: as
                    # perf.predict prices the overlapped forms the search also predicts for every layout
                    # (the plain form, which runs the two one after the other, is predicted in full too)
                    reduced = max(reduced, max(start + tail, e_start) + e_tail)
                    zb_reduced = max(zb_reduced, tail + e_tail)
                    opt_params += embedding // (e_holders if self.distributed_optimizer else 1)
                optimizer = max(optimizer, self.optimizer_s(isl, opt_params))
                first += n
        reduction = max(0.0, reduced - pipeline)
        e = Estimate(templates=tuple(templates), layer_counts=tuple(all_counts), micro_batches=tuple(split),
                     micro_batch_size=mbs, recompute=recompute, stage_recompute=tuple(all_flags),
                     iteration_time_s=pipeline + reduction + optimizer,
                     zb_iteration_time_s=zb_pipeline + zb_reduced + optimizer)
        if not recompute and not cap_hit:
            self._no_cap_hit[(tuple(templates), mbs)] = e
        return e
