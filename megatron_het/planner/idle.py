"""Idle hardware is a decision: for every island the chosen plan leaves (partly) unused, name the
GPUs, give the predicted throughput of the best priced plan that uses them, and say why it lost.

The alternative is the fastest closed-form point of the search that puts at least half of the
island's idle GPUs to work; it is priced as the chosen plan was (``perf.predict``, in its fastest
runnable schedule and gradient-reduction form) so that the two figures are comparable. Why it lost
is read off the two predictions: the part of the iteration that grew most (gradient reduction:
the stage whose reduction ends last and the network it crosses, a link between islands or the
island's own; recomputation added: memory; as many micro-batches on its slowest replica:
batch divisibility; more on fewer, deeper replicas: batch split; otherwise the pipeline: stage
balance and transfers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megatron_het.cluster import ClusterSpec
from megatron_het.perf.predict import Prediction
from megatron_het.plan.types import Plan
from megatron_het.planner.estimate import Estimate
from megatron_het.planner.space import island_gpus_used
from megatron_het.planner.summary import plan_form

__all__ = ["idle_islands", "explain_idle", "crossed_link_gbps", "reduction_reason"]

_TIE = 5e-4  # an alternative this close to the chosen plan's time is no faster: ties go to fewer GPUs
_TRIES = 4  # alternatives built and predicted per idle island before giving up


def idle_islands(cluster: ClusterSpec, plan: Plan) -> dict[str, int]:
    """Island name -> GPUs the plan does not use (islands fully used are left out)."""
    used: dict[str, int] = {}
    for r in plan.replicas:
        for s in r.stages:
            used[s.island] = used.get(s.island, 0) + s.tp
    return {i.name: i.num_gpus - used.get(i.name, 0) for i in cluster.islands if used.get(i.name, 0) < i.num_gpus}


def _holder_islands(plan: Plan) -> dict[int, set[str]]:
    """Layer -> the islands holding it in some replica (a reduction's peers are spread over them)."""
    holders: dict[int, set[str]] = {}
    for r in plan.replicas:
        for s in r.stages:
            for layer in range(s.layers[0], s.layers[1]):
                holders.setdefault(layer, set()).add(s.island)
    return holders


def crossed_link_gbps(cluster: ClusterSpec, plan: Plan, layers: tuple[int, int]) -> float | None:
    """The slowest link the gradient reduction of ``layers`` crosses in ``plan`` (links among the
    islands holding those layers); None when every holder is on one island."""
    holders = _holder_islands(plan)
    names = set().union(*(holders.get(layer, set()) for layer in range(*layers)))
    speeds = [link.bandwidth_gbps for a in names for b in names if a < b
              if (link := cluster.link(a, b)) is not None]
    return min(speeds) if speeds else None


def reduction_reason(cluster: ClusterSpec, alt: tuple[Plan, Prediction], d_red: float) -> str:
    """The stage whose reduction ends last sets what is exposed: name it and the network it crosses."""
    plan, pred = alt
    st, sp = max(((s, ps) for r, pr in zip(plan.replicas, pred.replicas) for s, ps in zip(r.stages, pr.stages)),
                 key=lambda t: t[1].gradient_reduction_end_s)
    where = f"layers {st.layers[0]}-{st.layers[1] - 1} on {st.island} (TP={st.tp})"
    link = crossed_link_gbps(cluster, plan, st.layers)
    if link is not None:
        return (f"links: the gradients of {where} are reduced across islands (slowest link crossed: "
                f"{link:g} Gbit/s), +{d_red:.3g} s exposed")
    island = cluster.island(st.island)
    net = (f"its {island.inter_node_bandwidth_gbps:g} Gbit/s inter-node network" if island.nodes > 1
           else "one node")
    return (f"gradient reduction: the gradients of {where} are reduced within {st.island} ({net}) and end "
            f"last, +{d_red:.3g} s exposed")


def _why(cluster: ClusterSpec, island: str, best: tuple[Plan, Prediction], alt: tuple[Plan, Prediction]) -> str:
    (plan, pred), (alt_plan, alt_pred) = best, alt
    d_red = alt_pred.gradient_reduction_s - pred.gradient_reduction_s
    d_pipe = alt_pred.pipeline_time_s - pred.pipeline_time_s
    d_opt = alt_pred.optimizer_s - pred.optimizer_s
    rc, alt_rc = (sum(s.recompute for r in p.replicas for s in r.stages) for p in (plan, alt_plan))
    most = max(r.num_micro_batches for r in plan.replicas)
    alt_most = max(r.num_micro_batches for r in alt_plan.replicas)
    if alt_pred.iteration_time_s <= pred.iteration_time_s * (1 + _TIE):
        return (f"batch divisibility: no faster, micro-batches are whole and the slowest replica still runs "
                f"{alt_most} (the chosen plan's: {most}), so the GPUs stay free")
    if d_red >= max(d_pipe, d_opt) and d_red > 0:
        return reduction_reason(cluster, alt, d_red)
    if alt_rc > rc and d_pipe > 0:
        return f"memory: {alt_rc} stages must recompute activations to fit, +{d_pipe:.3g} s of pipeline"
    if alt_most == most and d_pipe >= 0:
        return (f"batch divisibility: micro-batches are whole, its slowest replica still runs {alt_most} "
                f"(the chosen plan's: {most}), +{d_pipe:.3g} s of pipeline")
    if alt_most > most and d_pipe >= 0:
        depth = max(len(r.stages) for r in alt_plan.replicas)
        chosen_depth = max(len(r.stages) for r in plan.replicas)
        return (f"batch split: its {len(alt_plan.replicas)} replicas of up to {depth} stages run up to {alt_most} "
                f"micro-batches each (the chosen plan's {len(plan.replicas)} of up to {chosen_depth}: {most}), "
                f"+{d_pipe:.3g} s of pipeline")
    if d_opt > max(d_pipe, 0.0):
        return f"optimizer step: +{d_opt:.3g} s on the slowest stage"
    return (f"pipeline: stage balance and transfers to {island} make its slowest replica +{d_pipe:.3g} s "
            f"({alt_most} micro-batches vs {most})")


def explain_idle(cluster: ClusterSpec, best: tuple[Plan, Prediction], estimates: Sequence[Estimate], *,
                 build: Callable[[Estimate], Plan | None], price: Callable[[Plan], tuple[Plan, Prediction]],
                 islands: Sequence[str] | None = None) -> list[str]:
    """One line per island (of ``islands``, default all) with idle GPUs. ``estimates`` are the
    search's priced points, fastest first; ``build`` turns one into a valid Plan (None when it is
    not), ``price`` gives it in its fastest form (schedule, reduction) with its prediction."""
    idle = {k: v for k, v in idle_islands(cluster, best[0]).items() if islands is None or k in islands}
    lines = []
    names = [i.name for i in cluster.islands]
    used_now = {name: cluster.island(name).num_gpus - idle.get(name, 0) for name in names}
    for name, count in idle.items():
        isl = names.index(name)
        device = cluster.island(name).device.name
        head = f"idle: {count} of {cluster.island(name).num_gpus} {device} on {name}"
        alt, tries = None, 0
        for e in estimates:
            if island_gpus_used(e.templates, len(names))[isl] < used_now[name] + max(1, count // 2):
                continue
            plan = build(e)
            if plan is None:
                continue
            tries += 1
            if tries > _TRIES:
                break
            priced = price(plan)
            if priced[1].fits:
                alt = priced
                break
        if alt is None:
            lines.append(f"{head}: no priced plan uses them (too few for one more stage group, or over "
                         "memory at every TP size tried)")
            continue
        alt_used = sum(s.tp for r in alt[0].replicas for s in r.stages if s.island == name)
        loss = 1 - alt[1].tokens_per_s / best[1].tokens_per_s
        lines.append(f"{head}: the best plan using {alt_used} of them ({plan_form(alt[0])}) predicts "
                     f"{alt[1].tokens_per_s:.4g} tokens/s, "
                     f"{100 * loss:.1f}% below the chosen {best[1].tokens_per_s:.4g}; lost on "
                     + _why(cluster, name, best, alt))
    return lines
