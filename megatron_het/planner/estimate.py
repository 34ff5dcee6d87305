"""Fast closed-form estimate of a search point, used to rank candidates before the full
prediction (which simulates every pipeline) is run on the best few.

A replica of stage times ``tau_j = f_j + b_j`` running 1F1B over m micro-batches takes
``sum(tau) + 2 * sum(hops) + (m - 1) * max(tau)``; gradient reduction and the optimizer step are
priced as in :func:`megatron_het.perf.predict`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_het.cluster import ClusterSpec, ModelSpec
from megatron_het.perf.comm import activation_message_bytes, dp_gradient_reduction, p2p_time
from megatron_het.perf.flops import stage_parameters
from megatron_het.perf.memory import GRAD_BYTES, device_capacity_bytes, stage_memory
from megatron_het.perf.predict import OPTIMIZER_STEP_BYTES, StageCost, stage_cost
from megatron_het.perf.profile import Profile
from megatron_het.planner.space import Template, allocate_micro_batches, balanced_split

__all__ = ["Estimate", "Estimator"]


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """One fully specified search point and its closed-form iteration time."""

    templates: tuple[Template, ...]  # replica templates with counts
    layer_counts: tuple[tuple[int, ...], ...]  # per template, layers per stage
    micro_batches: tuple[tuple[int, int], ...]  # per template, (m, replicas getting m; the rest m - 1)
    micro_batch_size: int  # sequences per micro-batch
    recompute: bool  # full recomputation on every stage
    iteration_time_s: float  # closed-form estimate


class Estimator:
    """Prices search points; holds per-search caches (one instance per plan_cluster call)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, *, global_batch_size: int,
                 profile: Profile | Sequence[Profile] | None, distributed_optimizer: bool) -> None:
        self.model = model
        self.cluster = cluster
        self.global_batch_size = global_batch_size
        self.profile = profile
        self.distributed_optimizer = distributed_optimizer
        self._costs: dict[tuple[int, int, int, bool], StageCost] = {}
        self._mem: dict[tuple[object, ...], tuple[int, int, int, int]] = {}
        self._hops: dict[tuple[object, ...], float] = {}
        self._red: dict[tuple[object, ...], tuple[float, float]] = {}
        self._params: dict[tuple[object, ...], int] = {}
        self._capacity = [device_capacity_bytes(i.device) for i in cluster.islands]

    def cost(self, isl: int, tp: int, mbs: int, recompute: bool) -> StageCost:
        key = (isl, tp, mbs, recompute)
        if key not in self._costs:
            island = self.cluster.islands[isl]
            self._costs[key] = stage_cost(self.model, island, tp=tp, micro_batch_size=mbs, recompute=recompute,
                                          slowdown=self.cluster.slowdown(island.name), profile=self.profile)
        return self._costs[key]

    def memory_line(self, isl: int, tp: int, mbs: int, recompute: bool, *, first: bool, last: bool,
                    in_flight: int, dp: int) -> tuple[int, int]:
        """(bytes with 1 layer, bytes per extra layer) on one rank of such a stage."""
        shard = dp if self.distributed_optimizer and dp > 1 else 1
        key = (isl, tp, mbs, recompute, first, last, in_flight)
        if key not in self._mem:
            # Unsharded lines, optimizer kept apart so one entry serves every replica count.
            args = dict(is_first=first, is_last=last, micro_batch_size=mbs, microbatches_in_flight=in_flight,
                        tp=tp, recompute="full" if recompute else "none", distributed_optimizer=False)
            one = stage_memory(self.model, num_layers=1, **args)
            two = stage_memory(self.model, num_layers=2, **args)
            self._mem[key] = (one.total_bytes - one.optimizer_bytes, two.total_bytes - two.optimizer_bytes
                              - one.total_bytes + one.optimizer_bytes, one.optimizer_bytes,
                              two.optimizer_bytes - one.optimizer_bytes)
        rest, rest_slope, opt, opt_slope = self._mem[key]
        return rest + -(-opt // shard), rest_slope + opt_slope / shard

    def cap(self, isl: int, tp: int, mbs: int, recompute: bool, *, first: bool, last: bool, in_flight: int,
            dp: int) -> int:
        """Most layers such a stage can hold in device memory (0: not even one)."""
        one, slope = self.memory_line(isl, tp, mbs, recompute, first=first, last=last, in_flight=in_flight, dp=dp)
        capacity = self._capacity[isl]
        if one > capacity:
            return 0
        return 1 + int((capacity - one) // slope) if slope > 0 else self.model.num_layers

    def hop(self, a: tuple[int, int], b: tuple[int, int], mbs: int) -> float:
        key = (a, b, mbs)
        if key not in self._hops:
            (ia, ta), (ib, tb) = a, b
            ca, cb = self.cluster.islands[ia], self.cluster.islands[ib]
            nbytes = activation_message_bytes(self.model, micro_batch_size=mbs, tp=ta)
            same = ia == ib and (ca.nodes == 1 or ta + tb <= ca.gpus_per_node)
            self._hops[key] = p2p_time(nbytes, self.cluster, src=ca.name, dst=cb.name, same_node=same)
        return self._hops[key]

    def reduction(self, counts: tuple[tuple[int, int], ...], nbytes: float) -> float:
        """dp_gradient_reduction among replicas placed ``counts`` ((island, replicas), ...); it is
        affine in bytes, so two evaluations per placement serve every size."""
        if sum(n for _, n in counts) <= 1:
            return 0.0
        if counts not in self._red:
            names = [self.cluster.islands[i].name for i, n in counts for _ in range(n)]
            t0 = dp_gradient_reduction(0.0, self.cluster, replica_islands=names).total_s
            t1 = dp_gradient_reduction(1e9, self.cluster, replica_islands=names).total_s
            self._red[counts] = (t0, (t1 - t0) / 1e9)
        t0, slope = self._red[counts]
        return t0 + slope * nbytes

    def params(self, n: int, first: bool, last: bool, tp: int) -> int:
        key = (n, first, last, tp)
        if key not in self._params:
            self._params[key] = stage_parameters(self.model, num_layers=n, is_first=first, is_last=last, tp=tp)
        return self._params[key]

    def evaluate(self, templates: Sequence[Template], mbs: int, recompute: bool) -> Estimate | str:
        """The estimate, or a reason string when the point is infeasible."""
        model, L = self.model, self.model.num_layers
        total_mb = self.global_batch_size // mbs
        replicas = sum(t.count for t in templates)
        if replicas > total_mb:
            return (f"{replicas} replicas need at least {replicas} micro-batches but global_batch_size "
                    f"{self.global_batch_size} / micro_batch_size {mbs} = {total_mb}")
        max_m = total_mb - replicas + 1
        groups, all_counts = [], []
        for t in templates:
            stages = t.stage_islands()
            p = len(stages)
            if p > L:
                return f"{p} stages > num_layers {L}"
            per_layer, fixed, caps = [], [], []
            for j, (isl, tp) in enumerate(stages):
                c = self.cost(isl, tp, mbs, recompute)
                first, last = j == 0, j == p - 1
                per_layer.append(c.layer_forward_s + c.layer_backward_s)
                fixed.append((c.embedding_forward_s + c.embedding_backward_s if first else 0.0)
                             + (c.output_forward_s + c.output_backward_s if last else 0.0))
                caps.append(self.cap(isl, tp, mbs, recompute, first=first, last=last,
                                     in_flight=min(p - j, max_m), dp=replicas))
            counts = balanced_split(L, per_layer, fixed, caps)
            if counts is None:
                names = "+".join(f"{self.cluster.islands[s.island].name}(TP={s.tp},PP={s.pp})" for s in t.segments)
                return (f"{names}, micro_batch_size {mbs}, recompute {recompute}: stages hold at most "
                        f"{sum(min(c, L) for c in caps)} of {L} layers in memory")
            taus = [f + n * x for f, n, x in zip(fixed, counts, per_layer)]
            hops = sum(self.hop(stages[j], stages[j + 1], mbs) + self.hop(stages[j + 1], stages[j], mbs)
                       for j in range(p - 1))
            groups.append((t.count, sum(taus) + hops, max(taus)))
            all_counts.append(counts)
        alloc = allocate_micro_batches(total_mb, groups)
        if alloc is None:
            return f"cannot give each of {replicas} replicas a micro-batch"
        split, pipeline = alloc
        # Reduction peers of a stage: in every template, the stage holding the same first layer.
        holders = []
        for t, counts in zip(templates, all_counts):
            bounds, first = [], 0
            for (isl, _), n in zip(t.stage_islands(), counts):
                bounds.append((first, first + n, isl))
                first += n
            holders.append((t.count, bounds))
        reduction = optimizer = 0.0
        for t, counts in zip(templates, all_counts):
            stages, first = t.stage_islands(), 0
            for j, ((isl, tp), n) in enumerate(zip(stages, counts)):
                params = self.params(n, j == 0, j == len(stages) - 1, tp)
                where: dict[int, int] = {}
                for cnt, bounds in holders:
                    peer = next(i for a, b, i in bounds if a <= first < b)
                    where[peer] = where.get(peer, 0) + cnt
                reduction = max(reduction, self.reduction(tuple(sorted(where.items())), GRAD_BYTES * params))
                island = self.cluster.islands[isl]
                shard = replicas if self.distributed_optimizer else 1
                optimizer = max(optimizer, self.cluster.slowdown(island.name) * OPTIMIZER_STEP_BYTES * params
                                / shard / (island.device.memory_bandwidth_gbs * 1e9))
                first += n
        return Estimate(templates=tuple(templates), layer_counts=tuple(all_counts), micro_batches=tuple(split),
                        micro_batch_size=mbs, recompute=recompute,
                        iteration_time_s=pipeline + reduction + optimizer)
