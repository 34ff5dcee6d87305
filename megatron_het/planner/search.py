"""plan_cluster: search heterogeneous plans with islands as the units.

The search grows with the number of islands, not GPUs. Two families of replica layouts are
enumerated (HetHub/Tangram/Cephalo-inspired):

- local: every island runs its own identical replicas (one TP and PP per island); replicas of
  different islands differ in layout and get micro-batches in proportion to their speed;
- spanning: k identical replicas each run a pipeline across several islands (pp_i stages of
  TP tp_i on island i), which lets an island too small for the model on its own contribute
  and keeps the gradient reduction of every layer inside one island.

Each point (+ micro-batch size, recompute on/off) is priced in closed form (estimate.py) with the
layer split balanced by stage speed under memory caps and the micro-batches allocated to minimise
the slowest replica; the best few are then predicted in full (pipeline simulation, perf.predict)
and ranked. ``exhaustive=True`` drops the pruning (every TP, every PP, every replica count, every
island order) and predicts many more; it is the optimality reference for small clusters.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from megatron_het.cluster import ClusterSpec, ModelSpec
from megatron_het.perf.bounds import check_global_batch_size
from megatron_het.perf.predict import Prediction, predict
from megatron_het.perf.profile import Profile
from megatron_het.plan.errors import PlanError
from megatron_het.plan.types import Plan
from megatron_het.plan.validate import validate_plan
from megatron_het.planner.block_recompute import least_recompute_layers
from megatron_het.planner.compose import compose
from megatron_het.planner.errors import InfeasibleError
from megatron_het.planner.estimate import Estimate, Estimator
from megatron_het.planner.explain import explain_choice, island_infeasibility
from megatron_het.planner.grad_overlap import overlap_note, overlap_variants
from megatron_het.planner.idle import explain_idle
from megatron_het.planner.parallelizer import Parallelizer
from megatron_het.planner.refine import hill_climb
from megatron_het.planner.schedule_choice import choose_schedule
from megatron_het.planner.space import Segment, Template, build_plan, moe_sequence_parallel

__all__ = ["PlannerResult", "expert_parallel_options", "plan_cluster", "plan_cluster_at", "with_seq_length"]

_FAST_PP = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)
_LOCAL_KEEP = 3  # fast mode: best local layouts kept per island before combining islands
_FAST_PREDICT = 8  # fast mode: candidates predicted in full
_EXHAUSTIVE_PREDICT = 40  # exhaustive mode: candidates predicted in full
_SPANNING_BUDGET = 2000  # fast mode: spanning structures per island subset before TP pruning kicks in
_CLIMB_STARTS = 6  # fast mode: best distinct candidates refined by hill climbing
_ZB_STARTS = 2  # fast mode: best distinct candidates under ZB-H1's estimate, climbed on that estimate
_PRUNE_BOUND = 1.10  # fast mode: structures whose lower bound exceeds the best estimate by this are not priced
_ZB_PREDICT = 3  # best points under ZB-H1's estimate predicted in full beside the 1F1B ranking's
_MAX_REASONS = 50  # infeasibility reasons kept in the result
_COMPOSE_SETTINGS = 2  # fast mode: (micro-batch size, recompute) pairs, best first, that composition explores
_COMPOSE_BASES = 3  # best distinct plans per pair whose idle GPUs composition tries to fill


@dataclass(kw_only=True)
class _Progress:
    """Search progress for a ``progress(done, total)`` callback; total grows as work is discovered."""

    callback: Callable[[int, int], None] | None  # the caller's display, or None
    done: int = 0  # structures priced + plans predicted so far
    total: int = 0  # work known so far (>= done)

    def add(self, n: int) -> None:
        self.total += n

    def step(self) -> None:
        self.done += 1
        self.total = max(self.total, self.done)  # hill-climbing neighbours are found one by one
        if self.callback is not None:
            self.callback(self.done, self.total)

    def finish(self) -> None:
        self.total = self.done  # the last call has done == total
        if self.callback is not None:
            self.callback(self.done, self.total)


@dataclass(frozen=True, kw_only=True)
class PlannerResult:
    """What the planner chose and why."""

    best: Plan  # validated, with ``predicted`` attached
    candidates: list[tuple[Plan, Prediction]]  # top plans, fastest first (best is candidates[0])
    explanation: str  # why this plan, in words
    infeasible: list[str]  # reasons some layouts were pruned (memory, divisibility), deduplicated
    idle: tuple[str, ...] = ()  # per island with unused GPUs: the best plan using them and why it lost


def with_seq_length(model: ModelSpec, seq_length: int | None) -> ModelSpec:
    """The model at another sequence length (positions grow with it when needed)."""
    if seq_length is None or seq_length == model.seq_length:
        return model
    return replace(model, seq_length=seq_length,
                   max_position_embeddings=max(model.max_position_embeddings, seq_length))


def _pp_values(limit: int, exhaustive: bool) -> list[int]:
    if exhaustive:
        return list(range(1, limit + 1))
    return [p for p in _FAST_PP if p <= limit]


def _local_templates(model: ModelSpec, cluster: ClusterSpec, isl: int, *, tps: Sequence[int], max_replicas: int,
                     exhaustive: bool) -> list[Template]:
    island = cluster.islands[isl]
    out = []
    for tp in tps:
        for pp in _pp_values(min(model.num_layers, island.num_gpus // tp), exhaustive):
            count = min(island.num_gpus // (tp * pp), max_replicas)
            if count >= 1:
                out.append(Template(segments=(Segment(island=isl, tp=tp, pp=pp),), count=count))
    return out


def _orders(subset: tuple[int, ...], cluster: ClusterSpec, exhaustive: bool) -> list[tuple[int, ...]]:
    if exhaustive or len(subset) <= 3:
        return list(itertools.permutations(subset))
    by_memory = tuple(sorted(subset, key=lambda i: (-cluster.islands[i].device.memory_gib, i)))
    return list(dict.fromkeys((by_memory, subset, by_memory[::-1], subset[::-1])))


def _spanning_structures(model: ModelSpec, cluster: ClusterSpec, *, tps: dict[int, Sequence[int]],
                         max_replicas: int, exhaustive: bool,
                         wide_tps: dict[int, Sequence[int]] | None = None) -> list[tuple[Template, ...]]:
    """Spanning layouts; with ``wide_tps`` a subset is searched over those TPs when that stays
    within _SPANNING_BUDGET structures, else over ``tps``."""
    n = len(cluster.islands)
    L = model.num_layers
    subsets = [s for r in range(2, n + 1) for s in itertools.combinations(range(n), r)]
    if not exhaustive and n > 4:
        subsets = [s for s in subsets if len(s) in (2, n)]
    out = []
    for subset in subsets:
        if any(not tps[i] for i in subset):
            continue
        ks = set()
        for i in subset:
            g = cluster.islands[i].num_gpus
            for tp in (wide_tps or tps)[i]:
                for pp in _pp_values(max(1, g // tp), exhaustive=False):
                    if 1 <= g // (tp * pp) <= max_replicas:
                        ks.add(g // (tp * pp))
        if exhaustive:
            ks = set(range(1, min(max_replicas, max(cluster.islands[i].num_gpus for i in subset)) + 1))
        use = tps
        if wide_tps is not None and not exhaustive:
            size = len(_orders(subset, cluster, exhaustive)) * len(ks)
            for i in subset:
                size *= len(wide_tps[i])
            if size <= _SPANNING_BUDGET:
                use = wide_tps
        for order in _orders(subset, cluster, exhaustive):
            for k in sorted(ks):
                choices = []
                for i in order:
                    g = cluster.islands[i].num_gpus
                    opts = []
                    for tp in use[i]:
                        top = min(g // (k * tp), L)
                        pps = range(max(1, top // 2), top + 1) if exhaustive else ([top] if top >= 1 else [])
                        opts += [(tp, pp) for pp in pps]
                    choices.append(opts)
                for combo in itertools.product(*choices):
                    if sum(pp for _, pp in combo) > L:
                        continue
                    segs = tuple(Segment(island=i, tp=tp, pp=pp) for i, (tp, pp) in zip(order, combo))
                    out.append((Template(segments=segs, count=k),))
    return out


_MAX_EXPERT_PARALLEL = 64  # largest EP the planner tries by itself (Megatron-LM's MoE recipes stay within it)


def expert_parallel_options(model: ModelSpec, cluster: ClusterSpec) -> list[int]:
    """The EP sizes the planner searches for an MoE model: 1 (experts replicated) and every divisor of
    ``num_experts`` up to the cluster's GPUs and ``_MAX_EXPERT_PARALLEL``; [1] for a dense model."""
    if not model.is_moe:
        return [1]
    limit = min(model.num_experts, cluster.num_gpus, _MAX_EXPERT_PARALLEL)
    return [ep for ep in range(1, limit + 1) if model.num_experts % ep == 0]


def plan_cluster(model: ModelSpec, cluster: ClusterSpec, *, expert_parallel: int | None = None,
                 progress: Callable[[int, int], None] | None = None, **options) -> PlannerResult:
    """Search plans for ``model`` on ``cluster`` and return the fastest predicted one (options:
    :func:`plan_cluster_at`'s). An MoE model is searched at every EP of ``expert_parallel_options``
    (``expert_parallel`` None) or at the one given (Plan.expert_parallel; expert-TP = each stage's TP):
    EP trades the experts' memory and optimizer step on each rank for an all-to-all per MoE layer, so
    the memory it frees (shorter pipelines, fewer TP ranks, more replicas) is searched, not bolted on."""
    if expert_parallel is not None and expert_parallel != 1:
        if not model.is_moe:
            raise InfeasibleError(f"expert_parallel: {expert_parallel} needs an MoE model (num_experts), got a dense "
                                  "one. Fix: plan at expert_parallel 1, or describe the model's experts")
        if expert_parallel < 1 or model.num_experts % expert_parallel:
            raise InfeasibleError(f"expert_parallel: {expert_parallel} must divide num_experts {model.num_experts}. "
                                  f"Fix: use one of {expert_parallel_options(model, cluster)}")
    given = getattr(options.get("parallelizer"), "expert_parallel", None)  # a parallelizer prices one EP
    if given is not None and expert_parallel is not None and given != expert_parallel:
        raise InfeasibleError(f"expert_parallel: {expert_parallel}, but the parallelizer given prices EP {given}. "
                              f"Fix: build the parallelizer with expert_parallel={expert_parallel}")
    if expert_parallel is None and given is not None:
        expert_parallel = given
    eps = expert_parallel_options(model, cluster) if expert_parallel is None else [expert_parallel]
    results: list[tuple[int, PlannerResult]] = []
    failures: list[tuple[int, InfeasibleError]] = []
    counted = {"before": 0, "last": 0}  # one progress count over all the searches: the finished ones' work

    def tick(d: int, t: int) -> None:
        counted["last"] = t
        progress(counted["before"] + d, counted["before"] + t)

    for ep in eps:
        try:
            results.append((ep, plan_cluster_at(model, cluster, expert_parallel=ep,
                                                progress=None if progress is None else tick, **options)))
        except InfeasibleError as err:
            failures.append((ep, err))
        counted["before"], counted["last"] = counted["before"] + counted["last"], 0
    if progress is not None:  # the last search may have failed before its last count: done == total at the end
        progress(counted["before"], counted["before"])
    if not results:
        if len(failures) == 1:
            raise failures[0][1]
        raise _no_expert_parallelism_fits(model, failures)
    ep, best = min(results, key=lambda r: r[1].candidates[0][1].iteration_time_s)
    if len(eps) == 1:
        return best
    times = ", ".join(f"EP {e} {r.candidates[0][1].iteration_time_s:.3f} s" for e, r in results)
    lost = "".join(f"; EP {e}: none fits" for e, _ in failures)
    note = f"Expert parallelism {ep} chosen among the EP sizes searched (best plan each: {times}{lost})."
    return replace(best, explanation=best.explanation + "\n" + note,
                   infeasible=best.infeasible + [f"EP {e}: {r}" for e, err in failures for r in err.reasons])


def _no_expert_parallelism_fits(model: ModelSpec, failures: list[tuple[int, InfeasibleError]]) -> InfeasibleError:
    """One error for every EP that failed: each EP's first reason, then EP 1's full report (the layout
    question without experts spread), and what EP itself needs."""
    lines = [f"no plan fits {model.name or 'the model'} at any expert parallelism searched:"]
    for ep, err in failures:
        first = err.reasons[0] if err.reasons else err.explanation.splitlines()[0]
        lines.append(f"  EP {ep}: {first}")
    base = dict(failures).get(1)
    if base is not None:
        lines.append("EP 1 (experts replicated): " + base.explanation)
    lines.append("EP > 1 needs each layout's replicas in groups of EP (identical, equal micro-batches), so a "
                 "global batch whose micro-batches (global / micro-batch size) divide into EP groups. Fix: add GPUs "
                 "or memory, or fix the EP with --expert-model-parallel-size to read one EP's report")
    return InfeasibleError("\n".join(lines), reasons=tuple(f"EP {ep}: {r}" for ep, err in failures
                                                           for r in err.reasons))


def plan_cluster_at(model: ModelSpec, cluster: ClusterSpec, *, global_batch_size: int, seq_length: int | None = None,
                    profile: Profile | Sequence[Profile] | None = None, top_k: int = 5, exhaustive: bool = False,
                    max_tp: int = 8, recompute_options: Sequence[bool] = (False, True),
                    micro_batch_sizes: Sequence[int] = (1, 2, 4, 8), distributed_optimizer: bool = True,
                    islands: Sequence[str] | None = None, overlap_grad_reduce: bool = False,
                    progress: Callable[[int, int], None] | None = None,
                    parallelizer: Parallelizer | None = None, compose_islands: bool = True,
                    consider_grad_overlap: bool = True, keep_distributed_optimizer: bool = False,
                    precision: str = "bf16", attention: str | None = None, expert_parallel: int = 1) -> PlannerResult:
    """Search plans for ``model`` on ``cluster`` at expert parallelism ``expert_parallel`` and return
    the fastest predicted one.

    ``islands`` restricts the search to those islands (the others get no ranks).
    ``parallelizer`` decides how a layer slice runs inside an island and prices it (planner/parallelizer.py;
    default: :class:`MegatronParallelizer` with ``max_tp``). ``compose_islands`` adds compositions of
    replicas of different shapes over the islands (planner/compose.py); off, only the local and
    spanning layouts are searched.
    ``overlap_grad_reduce`` prices plans for a runtime that overlaps stage 0's gradient reduction
    with its last backward, as megatron-core's DDP option of that name does (see perf.predict), a
    what-if. ``consider_grad_overlap`` (default on) also prices every predicted layout as megatron-het's
    runtime runs ``overlap_grad_reduce`` (every stage's all-reduce in buckets during its last backward,
    with the distributed optimizer kept and without it: planner/grad_overlap.py) and records the choice
    in the plan. ``keep_distributed_optimizer``: only the overlapped forms that keep the distributed
    optimizer (a run that asks for it: ``--hetero-plan auto --use-distributed-optimizer``).
    ``precision`` (a Plan precision) is what every point is priced at and what the plans record;
    ``attention`` (Plan.attention: "fused" or "unfused"; None: fused on GPUs) likewise. Raises
    :class:`InfeasibleError` (a ValueError) naming the failed memory or divisibility constraint.
    ``progress(done, total)`` is called after each candidate structure priced and each plan predicted
    in full; ``total`` counts the work known so far (it grows when a micro-batch size's combinations,
    spanning layouts and hill-climbing neighbours are generated) and equals ``done`` at the last call.
    """
    if global_batch_size < 1:
        raise InfeasibleError(f"global_batch_size: must be >= 1 (got {global_batch_size}). Fix: pass a positive "
                              "global batch size in sequences")
    check_global_batch_size(global_batch_size)
    if top_k < 1:
        raise InfeasibleError(f"top_k: must be >= 1 (got {top_k}). Fix: ask for at least one plan")
    model = with_seq_length(model, seq_length)
    allowed = set(cluster.island_names if islands is None else islands)
    unknown = allowed - set(cluster.island_names)
    if unknown:
        raise InfeasibleError(f"islands: unknown island(s) {sorted(unknown)} (got {list(islands or [])}). "
                              f"Fix: use names from {list(cluster.island_names)}")
    sizes = [b for b in micro_batch_sizes if b >= 1 and global_batch_size % b == 0]
    if not sizes:
        raise InfeasibleError(
            f"global_batch_size: {global_batch_size} is not divisible by any micro_batch_size in "
            f"{tuple(micro_batch_sizes)} (got {global_batch_size}). Fix: use a global batch size that is a "
            f"multiple of {min(micro_batch_sizes, default=1)}")
    est = Estimator(model, cluster, global_batch_size=global_batch_size, profile=profile,
                    distributed_optimizer=distributed_optimizer, overlap_grad_reduce=overlap_grad_reduce,
                    parallelizer=parallelizer, max_tp=max_tp, precision=precision, attention=attention,
                    expert_parallel=expert_parallel)
    active = [i for i, isl in enumerate(cluster.islands) if isl.name in allowed]
    reasons: dict[str, None] = {}
    estimates: list[Estimate] = []
    evaluated = 0
    counter = _Progress(callback=progress)
    local_tps: dict[tuple[int, bool], dict[int, list[int]]] = {}
    for mbs in sizes:  # every local layout is known before any is priced
        counter.add(len(recompute_options) * sum(
            len(_local_templates(model, cluster, i, tps=est.tp_sizes(i), max_replicas=global_batch_size // mbs,
                                 exhaustive=exhaustive)) for i in active))

    best_seen = math.inf  # fastest estimate so far under either key: what the fast mode prunes against

    def price(structure: tuple[Template, ...], mbs: int, rc: bool, *, prune: bool = True) -> Estimate | None:
        nonlocal evaluated, best_seen
        evaluated += 1
        counter.step()
        if prune and not exhaustive and est.lower_bound(structure, mbs) > _PRUNE_BOUND * best_seen:
            return None  # even a perfect pipeline of these GPUs would rank far below the best seen
        e = est.evaluate(structure, mbs, rc)
        if isinstance(e, str):
            if len(reasons) < _MAX_REASONS:
                reasons[e] = None
            return None
        estimates.append(e)
        best_seen = min(best_seen, e.iteration_time_s, e.zb_iteration_time_s)
        return e

    for mbs in sizes:
        max_replicas = global_batch_size // mbs
        for rc in recompute_options:
            per_island: dict[int, list[tuple[float, Template]]] = {}
            local_tps[(mbs, rc)] = {}
            for i in active:
                scored = []
                for t in _local_templates(model, cluster, i, tps=est.tp_sizes(i), max_replicas=max_replicas,
                                          exhaustive=exhaustive):
                    e = price((t,), mbs, rc, prune=False)  # every island's ranking decides its TPs below
                    if e is not None:
                        scored.append((e.iteration_time_s, t))
                scored.sort(key=lambda x: x[0])
                per_island[i] = scored if exhaustive else scored[:_LOCAL_KEEP]
                # TP sizes for composition: the island's best local layouts' TPs, else its largest.
                ranked_tps = list(dict.fromkeys(t.segments[0].tp for _, t in scored)) or list(est.tp_sizes(i))[::-1]
                local_tps[(mbs, rc)][i] = list(est.tp_sizes(i)) if exhaustive else ranked_tps[:2]
            # Combine islands' local layouts (None = island unused).
            options = [[None] + [t for _, t in per_island[i]] for i in active]
            counter.add(math.prod(len(o) for o in options) - 1 - sum(len(o) - 1 for o in options))  # >= 2 islands
            for combo in itertools.product(*options):
                chosen = tuple(t for t in combo if t is not None)
                if len(chosen) < 2:
                    continue
                total = sum(t.count for t in chosen)
                if total > max_replicas:
                    scale = max_replicas / total  # too few micro-batches: shrink replica counts
                    chosen = tuple(replace(t, count=max(1, int(t.count * scale))) for t in chosen)
                price(chosen, mbs, rc)
            # Fast mode: spanning replicas use each island's best local TP (its largest TP when
            # the island cannot hold a replica alone).
            tps = {i: [per_island[i][0][1].segments[0].tp] if per_island[i]
                   else list(est.tp_sizes(i))[-1:] for i in active}
            if exhaustive:
                tps = {i: list(est.tp_sizes(i)) for i in active}
            sub = _restrict(cluster, active)
            wide = {k: list(est.tp_sizes(v)) for k, v in enumerate(active)}
            spanning = _spanning_structures(model, sub.view, tps={k: tps[v] for k, v in enumerate(active)},
                                            max_replicas=max_replicas, exhaustive=exhaustive, wide_tps=wide)
            counter.add(len(spanning))
            for structure in spanning:
                price(sub.lift(structure), mbs, rc)

    if not estimates:
        raise InfeasibleError(_infeasible_text(est, active, sizes, recompute_options, max_tp, reasons),
                              reasons=tuple(reasons))
    estimates.sort(key=lambda e: e.iteration_time_s)
    if compose_islands and len(active) > 1:  # Tangram: replicas of different shapes over every island
        settings: dict[tuple[int, bool], list[tuple[Template, ...]]] = {}
        for e in estimates:
            bases = settings.setdefault((e.micro_batch_size, e.recompute), [])
            if len(bases) < _COMPOSE_BASES and e.templates not in bases:
                bases.append(e.templates)
        picked = list(settings.items()) if exhaustive else list(settings.items())[:_COMPOSE_SETTINGS]
        for (mbs, rc), bases in picked:
            for structure in compose(est, active, tps=local_tps[(mbs, rc)], mbs=mbs, recompute=rc, bases=bases,
                                     exhaustive=exhaustive):
                counter.add(1)
                price(structure, mbs, rc)
        estimates.sort(key=lambda e: e.iteration_time_s)
    if not exhaustive:  # recover what the pruning missed around the best few starting points
        all_tps = {i: list(est.tp_sizes(i)) for i in active}
        seen_layouts: set[tuple[object, ...]] = set()
        starts = _distinct_layouts(estimates, _CLIMB_STARTS, seen_layouts)
        for e in starts:
            hill_climb(e, price, cluster, tps=all_tps, num_layers=model.num_layers,
                       global_batch_size=global_batch_size, micro_batch_sizes=sizes,
                       recompute_options=recompute_options)
        # ZB-H1 favours deeper pipelines than 1F1B (its deferred W fills the cool-down bubble that
        # grows with depth): climb from its own best points on its own estimate.
        for e in _distinct_layouts(sorted(estimates, key=lambda e: e.zb_iteration_time_s), _ZB_STARTS, seen_layouts):
            hill_climb(e, price, cluster, tps=all_tps, num_layers=model.num_layers,
                       global_batch_size=global_batch_size, micro_batch_sizes=sizes,
                       recompute_options=recompute_options, key=lambda e: e.zb_iteration_time_s)
        estimates.sort(key=lambda e: e.iteration_time_s)
    keep = _EXHAUSTIVE_PREDICT if exhaustive else max(_FAST_PREDICT, top_k)
    counter.add(min(keep, len(estimates)))  # full predictions (duplicates skipped may need a few more)
    ranked: list[tuple[Plan, Prediction]] = []
    seen: set[Plan] = set()
    considered: set[int] = set()

    # Per ranked plan: (schedule sentence, its 1F1B form, the prediction of the form as built when the
    # plan is an overlapped variant).
    notes: list[tuple[str, tuple[Plan, Prediction], Prediction | None]] = []

    simulations: dict = {}  # pipeline simulations shared by a layout's forms and schedules

    def predict_plan(plan: Plan) -> Prediction:
        return predict(plan, model, cluster, profile=profile, overlap_grad_reduce=overlap_grad_reduce,
                       simulations=simulations)

    def runnable_forms(plan: Plan, pred: Prediction) -> list[tuple[tuple[Plan, Prediction], Prediction | None]]:
        """The layout as built (``pred``: fits) and, memory permitting, with its reduction overlapped
        (grad_overlap.py: with and without the distributed optimizer), each with its prediction
        attached and, for an overlapped one, the prediction of the form as built."""
        forms: list[tuple[tuple[Plan, Prediction], Prediction | None]] = [
            ((replace(plan, predicted=pred.to_json_dict()), pred), None)]
        variants = overlap_variants(plan) if consider_grad_overlap else "not asked"
        for variant in ([] if isinstance(variants, str) else variants):
            if keep_distributed_optimizer and plan.use_distributed_optimizer and not variant.use_distributed_optimizer:
                continue
            try:
                validate_plan(variant, model, cluster)
                vpred = predict_plan(variant)
                if vpred.fits:
                    forms.append(((replace(variant, predicted=vpred.to_json_dict()), vpred), pred))
            except PlanError as err:
                reasons[f"internal: overlapped plan invalid: {err}"] = None
        return forms

    def least_recompute(chosen: tuple[Plan, Prediction]) -> tuple[Plan, Prediction]:
        """``chosen`` with its fully recomputing stages trimmed to the least block recomputation that
        fits (block_recompute.py), when that validates, fits and is faster; else ``chosen``."""
        plan, pred = chosen
        if not any(st.recompute for r in plan.replicas for st in r.stages):
            return chosen
        trimmed = least_recompute_layers(plan, model, cluster)
        if trimmed is plan:
            return chosen
        try:
            validate_plan(trimmed, model, cluster)
        except PlanError as err:
            reasons[f"internal: block-recompute plan invalid: {err}"] = None
            return chosen
        tpred = predict_plan(trimmed)
        if not tpred.fits or tpred.iteration_time_s >= pred.iteration_time_s:
            return chosen
        return replace(trimmed, predicted=tpred.to_json_dict()), tpred

    def fastest_form(plan: Plan) -> tuple[Plan, Prediction]:
        """``plan``'s layout in the fastest form and schedule the search would give it (idle.py
        compares the chosen plan with alternatives priced the same way)."""
        pred = predict_plan(plan)
        if not pred.fits:
            return plan, pred
        chosen = [choose_schedule(one_f, model, cluster, predict_plan=predict_plan, refine=least_recompute)[0]
                  for one_f, _ in runnable_forms(plan, pred)]
        return min(chosen, key=lambda c: c[1].iteration_time_s)

    def predict_point(e: Estimate) -> None:
        """Predict the point's layout under 1F1B, also with its reduction overlapped (grad_overlap.py:
        with the distributed optimizer kept and without it, where that fits), and each of those under every schedule the runtime runs (schedule_choice.py: a layout
        second under 1F1B may gain more from ZB-H1 or interleaving than the first, e.g. the
        overlapped variant, whose reduction ZB-H1's deferred W would otherwise expose); every
        schedule's form whose stages recompute every layer takes the least block recomputation that
        fits when that is faster (block_recompute.py) before the schedules are compared."""
        considered.add(id(e))
        plan = build_plan(cluster, e.templates, e.layer_counts, e.micro_batches, micro_batch_size=e.micro_batch_size,
                          global_batch_size=global_batch_size, recompute=e.recompute,
                          distributed_optimizer=distributed_optimizer, stage_recompute=e.stage_recompute,
                          precision=precision, attention=attention, sequence_parallel=moe_sequence_parallel(model),
                          expert_parallel=expert_parallel)
        key = plan  # frozen and hashable (nothing predicted yet): far cheaper than its JSON at 1,024 ranks
        if key in seen:
            return
        seen.add(key)
        try:
            validate_plan(plan, model, cluster)
        except PlanError as err:  # a bug in the search if it happens; keep the reason, skip the plan
            reasons[f"internal: generated plan invalid: {err}"] = None
            return
        pred = predict_plan(plan)
        counter.step()
        if not pred.fits:
            reasons[f"predicted memory {pred.memory_gib_per_rank_max:.1f} GiB exceeds a device"] = None
            return
        forms = runnable_forms(plan, pred)
        for one_f, sharded_alt in forms:
            chosen, note = choose_schedule(one_f, model, cluster, predict_plan=predict_plan, refine=least_recompute)
            ranked.append(chosen)
            notes.append((note, one_f, sharded_alt))
            origin.append(e)

    origin: list[Estimate] = []  # the point behind each ranked plan
    for e in estimates:
        if len({id(o) for o in origin}) >= keep:  # layouts predicted (each may rank in two forms)
            break
        predict_point(e)
    # Then the best point of every (micro-batch size, recompute) setting not predicted yet:
    # near-identical compositions must not crowd out a setting the full prediction ranks differently.
    best_of: dict[tuple[int, bool], Estimate] = {}
    for e in estimates:
        best_of.setdefault((e.micro_batch_size, e.recompute), e)
    rest = [e for e in best_of.values() if id(e) not in considered]
    # And the best points under ZB-H1's estimate (deep pipelines the 1F1B ranking puts low).
    zb_points = _distinct_layouts(sorted(estimates, key=lambda e: e.zb_iteration_time_s), _ZB_PREDICT, set())
    rest += [e for e in zb_points if id(e) not in considered and all(e is not r for r in rest)]
    # And the structure predicted fastest so far (its best schedule) at every other setting (the
    # closed form's ranking of micro-batch sizes is the least certain part of it).
    if ranked:
        top = origin[min(range(len(ranked)), key=lambda k: ranked[k][1].iteration_time_s)]
        for mbs in sizes:
            for rc in recompute_options:
                if (mbs, rc) != (top.micro_batch_size, top.recompute):
                    e = est.evaluate(top.templates, mbs, rc)
                    if not isinstance(e, str):
                        rest.append(e)
    counter.add(len(rest))
    for e in rest:
        predict_point(e)
    if not ranked:
        raise InfeasibleError(_infeasible_text(est, active, sizes, recompute_options, max_tp, reasons),
                              reasons=tuple(reasons))
    order = sorted(range(len(ranked)), key=lambda k: ranked[k][1].iteration_time_s)
    schedule_note, one_f, sharded_alt = notes[order[0]]
    ranked = [ranked[k] for k in order]
    overlap_line = overlap_note(one_f, sharded_alt)

    def build(e: Estimate) -> Plan | None:
        plan = build_plan(cluster, e.templates, e.layer_counts, e.micro_batches, micro_batch_size=e.micro_batch_size,
                          global_batch_size=global_batch_size, recompute=e.recompute,
                          distributed_optimizer=distributed_optimizer, stage_recompute=e.stage_recompute,
                          precision=precision, attention=attention, sequence_parallel=moe_sequence_parallel(model),
                          expert_parallel=expert_parallel)
        try:
            validate_plan(plan, model, cluster)
        except PlanError:
            return None
        return plan

    idle = explain_idle(cluster, ranked[0], estimates, build=build, islands=[cluster.islands[i].name for i in active],
                        price=fastest_form)
    counter.finish()
    explanation = explain_choice(model, cluster, ranked, evaluated, evaluated - len(estimates))
    best, grid_lines = ranked[0][0], []
    assign_tp_grids = getattr(est.parallelizer, "assign_tp_grids", None)  # a parallelizer offering 3D TP
    if assign_tp_grids is not None:
        best, grid_lines = assign_tp_grids(best)
        ranked[0] = (best, ranked[0][1])
    return PlannerResult(best=best, candidates=ranked[:top_k],
                         explanation="\n".join([explanation, *([overlap_line] if overlap_line else []), schedule_note,
                                                 *grid_lines, *idle]), infeasible=list(reasons),
                         idle=tuple(idle))


def _distinct_layouts(ranked: Sequence[Estimate], n: int, seen: set[tuple[object, ...]]) -> list[Estimate]:
    """The first ``n`` of ``ranked`` whose layouts are not in ``seen`` (updated): a point allowed to
    recompute that needs no recomputation is the same layout as the one that may not."""
    out = []
    for e in ranked:
        if len(out) >= n:
            break
        key = (e.templates, e.layer_counts, e.micro_batch_size, e.stage_recompute)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


@dataclass(frozen=True, kw_only=True)
class _Restricted:
    """A view of the cluster with only the active islands, and the map back to full indices."""

    view: ClusterSpec  # cluster with only the active islands (search indexes into it)
    index: tuple[int, ...]  # view island index -> full cluster island index

    def lift(self, structure: tuple[Template, ...]) -> tuple[Template, ...]:
        if self.index == tuple(range(len(self.index))):  # the view's indices are the cluster's: nothing to rebuild
            return structure
        return tuple(replace(t, segments=tuple(replace(s, island=self.index[s.island]) for s in t.segments))
                     for t in structure)


def _restrict(cluster: ClusterSpec, active: Sequence[int]) -> _Restricted:
    if len(active) == len(cluster.islands):
        return _Restricted(view=cluster, index=tuple(range(len(cluster.islands))))
    keep = {cluster.islands[i].name for i in active}
    view = ClusterSpec(islands=tuple(cluster.islands[i] for i in active),
                       links=tuple(link for link in cluster.links if set(link.between) <= keep),
                       emulation={k: v for k, v in cluster.emulation.items() if k in keep}, source=cluster.source)
    return _Restricted(view=view, index=tuple(active))


def _infeasible_text(est: Estimator, active: Sequence[int], sizes: Sequence[int], recompute_options: Sequence[bool],
                     max_tp: int, reasons: dict[str, None]) -> str:
    rc = any(recompute_options)
    lines = [island_infeasibility(est, i, max_tp=max_tp, micro_batch_size=min(sizes), recompute=rc) for i in active]
    total = sum(est.cluster.islands[i].num_gpus for i in active)
    lines.insert(0, f"no plan fits {est.model.name or 'the model'} on these {total} GPUs:")
    if reasons:
        lines.append("first pruned layouts: " + "; ".join(list(reasons)[:3]))
    lines.append("Fix: add GPUs (or GPUs with more memory), enable recompute, lower the micro-batch size "
                 "or the sequence length.")
    return "\n".join(lines)
