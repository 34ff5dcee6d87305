"""Heterogeneous plan throughput vs upper bounds and baselines: six device pairs and six clusters of
three or more device types (NVIDIA and AMD, old and new, cross-type links 4-8x slower than the
islands' own networks), each with llama2-7b and llama2-70b.

    python bench/planner_efficiency.py            # everything (a few minutes on a quiet core)
    python bench/planner_efficiency.py --quick    # the 1,024-GPU case of issue #19 only

Two upper bounds, both sums over the device types of the best plan the same planner finds on that
type's island alone: peak share (each island runs its share of the global batch in proportion to its
peak TFLOP/s, so per-replica micro-batch counts are comparable with the joint run) and same batch
(issue #19's wording: each island runs the whole global batch alone, with several times the
micro-batches per replica it gets in the joint run: a looser bound, the more so the more islands).
Baselines for the pairs: Megatron's uniform plan on the whole cluster (same TP/PP everywhere, equal
layers, equal micro-batches per replica; the best such plan that fits) and the fastest device type
alone. For every case: GPUs used, and whether every island with idle GPUs has an explanation
(PlannerResult.idle). Target: chosen / bound >= 0.95. Writes bench/results/planner_efficiency.json.

For the clusters of three or more types, also where the iteration goes (``chosen_breakdown`` and
``alone_same_batch_breakdown``: pipeline, exposed gradient reduction, optimizer step, sequences per
GPU) and why a case misses the same-batch bound (``miss_reason``), from planner/gap.py's bounds: the
fluid ceiling, the least time replicas kept on one island need for the batch with no
synchronisation (vs the time a 0.95 ratio allows), and what reducing their gradients across the
islands costs (as priced, and as the what-if of a sharded reduce-scatter + all-gather proper, from
perf.comm.sharded_gradient_reduction).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from harness import ROOT, stamp, write_result

from megatron_het.cluster import CATALOG, ClusterSpec, IslandSpec, LinkSpec, ModelSpec, load_cluster, load_model
from megatron_het.perf import predict
from megatron_het.perf.comm import (
    distributed_optimizer_share,
    dp_gradient_reduction,
    sharded_gradient_reduction,
)
from megatron_het.perf.memory import state_bytes
from megatron_het.plan import PlanError, validate_plan
from megatron_het.planner import InfeasibleError, Segment, Template, build_plan, plan_cluster, tp_options
from megatron_het.planner.estimate import Estimator
from megatron_het.planner.gap import fluid_tokens_per_s, island_capacity, one_island_time

PAIRS = (("A100-80GB", "H100-SXM"), ("A100-80GB", "MI250X"), ("H100-SXM", "MI300X"), ("V100-32GB", "A100-80GB"),
         ("A100-80GB", "L40S"), ("H100-SXM", "H200"))
GPUS_PER_ISLAND = (128, 64)  # first type, second type
GLOBAL_BATCH = 1024
# Clusters of three or more types (examples/clusters/), global batch size.
MULTI = (("tangram-1024.yaml", 2048), ("mixed3-256.yaml", 1024), ("v100-a100-mi300x.yaml", 1024),
         ("h200-h100-mi300x.yaml", 1024), ("a100-l40s-mi250x.yaml", 1024), ("four-types.yaml", 1024))
TARGET = 0.95


def cluster_of(a: str, b: str) -> ClusterSpec:
    islands = tuple(IslandSpec(name=f"{t.lower()}-pod", device=CATALOG[t], nodes=n // 8, gpus_per_node=8,
                               inter_node_bandwidth_gbps=200.0) for t, n in zip((a, b), GPUS_PER_ISLAND))
    return ClusterSpec(islands=islands, links=(LinkSpec(between=(islands[0].name, islands[1].name),
                                                        bandwidth_gbps=100.0),))


def uniform_baseline(model: ModelSpec, cluster: ClusterSpec) -> float:
    """Best Megatron-style uniform plan: one TP/PP for all, equal layers, equal micro-batches."""
    best = 0.0
    L = model.num_layers
    tps = set.intersection(*(set(tp_options(model, i, max_tp=8)) for i in cluster.islands))
    for tp in sorted(tps):
        for pp in (p for p in range(1, 33) if L % p == 0):
            counts = [i.num_gpus // (tp * pp) for i in cluster.islands]
            dp = sum(counts)
            for mbs in (1, 2, 4):
                if dp == 0 or GLOBAL_BATCH % (mbs * dp):
                    continue
                m = GLOBAL_BATCH // (mbs * dp)
                for rc in (False, True):
                    templates = [Template(segments=(Segment(island=i, tp=tp, pp=pp),), count=c)
                                 for i, c in enumerate(counts) if c]
                    plan = build_plan(cluster, templates, [[L // pp] * pp for _ in templates],
                                      [(m, t.count) for t in templates], micro_batch_size=mbs,
                                      global_batch_size=GLOBAL_BATCH, recompute=rc, distributed_optimizer=True)
                    try:
                        validate_plan(plan, model, cluster)
                    except PlanError:
                        continue
                    pred = predict(plan, model, cluster)
                    if pred.fits:
                        best = max(best, pred.tokens_per_s)
                        break  # recompute only helps memory
    return best


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def breakdown(plan, pred) -> dict:
    """Where one plan's iteration goes: pipeline, exposed gradient reduction, optimizer step, and how
    many sequences each GPU runs (the batch's granularity)."""
    return {"iteration_s": round(pred.iteration_time_s, 4), "pipeline_s": round(pred.pipeline_time_s, 4),
            "gradient_reduction_s": round(pred.gradient_reduction_s, 4), "optimizer_s": round(pred.optimizer_s, 4),
            "micro_batch_size": plan.micro_batch_size,
            "max_micro_batches_per_replica": max(r.num_micro_batches for r in plan.replicas),
            "sequences_per_gpu": round(plan.global_batch_size / pred.num_gpus, 2), "gpus": pred.num_gpus}


def alone(model: ModelSpec, cluster: ClusterSpec, global_batch: int, parts: dict | None = None) -> tuple[dict, dict]:
    """Per island: best tokens/s alone at its peak share of the batch, and alone at the whole batch
    (``parts``, if given, receives the latter's breakdown per island)."""
    share_tps, same_tps, peak = {}, {}, sum(i.peak_tflops for i in cluster.islands)
    for island in cluster.islands:
        share = max(8, round(global_batch * island.peak_tflops / peak / 8) * 8)
        for gbs, out in ((share, share_tps), (global_batch, same_tps)):
            try:
                plan, pred = plan_cluster(model, cluster, global_batch_size=gbs, islands=[island.name]).candidates[0]
            except InfeasibleError:
                out[island.name] = 0.0
                continue
            out[island.name] = pred.tokens_per_s
            if parts is not None and out is same_tps:
                parts[island.name] = breakdown(plan, pred)
    return share_tps, same_tps


def cross_island_reduction(est: Estimator, families: dict) -> tuple[float, float]:
    """Gradient synchronisation of data parallelism over every island, each island running the
    family its capacity was counted with (``families``: island index -> Family): the largest stage's
    per-rank parameters, reduce-scatter of the gradients + all-gather of the weights (distributed
    optimizer), as the predictor prices it (across collective libraries the runtime runs each of
    the two as the bridge's sharded all-reduce where every island has >= 2 replicas: a whole one
    each, perf.comm.distributed_optimizer_share; within one library through one leader per island)
    and as the what-if of a sharded reduce-scatter + all-gather proper (half of
    perf.comm.sharded_gradient_reduction each, whatever the libraries), which the bridge does not
    run yet."""
    cluster, L = est.cluster, est.model.num_layers
    used = {i: f for i, f in families.items() if f is not None}
    counts = {i: cluster.islands[i].num_gpus // (f.tp * f.pp) for i, f in used.items()}
    params = max(est.params(-(-L // f.pp), True, f.pp == 1, f.tp) for f in used.values())
    rpn = min(est.ranks_per_node(i, f.tp, f.pp, counts[i]) for i, f in used.items())
    names = [cluster.islands[i].name for i, n in counts.items() for _ in range(n)]
    weight, grad = state_bytes("bf16")[:2]
    share = distributed_optimizer_share(cluster, replica_islands=names)
    priced = sum(share * dp_gradient_reduction(b * params, cluster, replica_islands=names, ranks_per_node=rpn).total_s
                 for b in (grad, weight))
    what_if = sum(0.5 * sharded_gradient_reduction(b * params, cluster, replica_islands=names,
                                                   ranks_per_node=rpn).total_s for b in (grad, weight))
    return priced, what_if


def gap(model: ModelSpec, cluster: ClusterSpec, global_batch: int, row: dict) -> dict:
    """Why a case misses the same-batch bound (planner/gap.py): the fluid ceiling (every GPU at its
    best rate, no whole sequences, no synchronisation); the sequences replicas kept on one island
    complete, with no synchronisation at all, in the time a 0.95 ratio allows, and the least time
    they need for the whole batch; and what reducing the whole model's gradients across all the
    islands costs (data parallelism of one-island replicas pays it)."""
    est = Estimator(model, cluster, global_batch_size=global_batch, profile=None, distributed_optimizer=True)
    islands = list(range(len(cluster.islands)))
    fluid = fluid_tokens_per_s(est, islands)
    target_s = global_batch * model.seq_length / (TARGET * row["upper_bound_same_batch"])
    caps = {cluster.islands[i].name: island_capacity(est, i, target_s) for i in islands}
    capacity = sum(c for c, _ in caps.values())
    least_s = one_island_time(est, islands, global_batch)
    cross_s, sharded_s = cross_island_reduction(est, {i: caps[cluster.islands[i].name][1] for i in islands})
    out = {"fluid_tokens_per_s": fluid, "fluid_over_same_batch_bound": fluid / row["upper_bound_same_batch"],
           "target_iteration_s": round(target_s, 4), "one_island_capacity_at_target": round(capacity, 1),
           "one_island_capacity_per_island": {
               name: {"sequences": round(c, 1), **({"tp": f.tp, "pp": f.pp, "micro_batch_size": f.micro_batch_size,
                                                    "recompute": f.recompute} if f else {})}
               for name, (c, f) in caps.items()},
           "one_island_least_pipeline_s": round(least_s, 4), "cross_island_reduction_s": round(cross_s, 4),
           "cross_island_reduction_sharded_what_if_s": round(sharded_s, 4)}
    chosen = row["chosen_breakdown"]
    spent = (f"chosen: pipeline {chosen['pipeline_s']:.3f} s + reduction {chosen['gradient_reduction_s']:.3f} s "
             f"({chosen['sequences_per_gpu']} sequences/GPU)")
    if row["ratio_same_batch"] >= TARGET:
        out["miss_reason"] = ""
    elif least_s > target_s:
        out["miss_reason"] = (
            f"granularity: replicas kept on one island need >= {least_s:.3f} s for {global_batch} whole sequences "
            f"(any TP/PP/micro-batch size, no synchronisation; {capacity:.0f} fit in the {target_s:.3f} s a 0.95 "
            f"ratio allows); {spent}")
    else:
        out["miss_reason"] = (
            f"synchronisation: replicas kept on one island need >= {least_s:.3f} s of the {target_s:.3f} s a 0.95 "
            f"ratio allows, but reducing their gradients across the islands costs {cross_s:.3f} s (sharded reduce-scatter what-if: "
            f"{sharded_s:.3f} s); {spent}")
    return out


def joint(model: ModelSpec, cluster: ClusterSpec, global_batch: int) -> dict:
    start, cpu = time.perf_counter(), time.process_time()
    result = plan_cluster(model, cluster, global_batch_size=global_batch)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    plan, pred = result.candidates[0]
    used: dict[str, int] = {}
    for r in result.best.replicas:
        for st in r.stages:
            used[st.island] = used.get(st.island, 0) + st.tp
    idle = {i.name: i.num_gpus - used.get(i.name, 0) for i in cluster.islands if used.get(i.name, 0) < i.num_gpus}
    explained = all(any(line.startswith("idle: ") and f" on {name}:" in line for line in result.idle) for name in idle)
    return {"chosen_tokens_per_s": pred.tokens_per_s, "gpus_used": pred.num_gpus, "gpus": cluster.num_gpus,
            "gpus_used_per_island": used, "idle_gpus_per_island": idle, "idle_explained": explained,
            "idle_explanations": list(result.idle), "layouts": len({tuple((s.island, s.tp, s.layers) for s in r.stages)
                                                                     for r in result.best.replicas}),
            "planning_time_s": round(wall, 2), "planning_cpu_s": round(cpu, 2), "chosen_breakdown": breakdown(plan, pred)}


def multi_cases(models: list[ModelSpec], names=MULTI) -> list[dict]:
    rows = []
    print(f"{'cluster':<24} {'model':<11} {'chosen tok/s':>12} {'same-batch':>10} {'ratio':>6} {'peak-share':>10} "
          f"{'ratio':>6} {'used':>9} {'idle expl':>9} {'plan_s':>6} {'cpu_s':>6}")
    for name, gbs in names:
        cluster = load_cluster(ROOT / "examples/clusters" / name)
        for model in models:
            row = {"cluster": name, "devices": "+".join(f"{i.num_gpus}x{i.device.name}" for i in cluster.islands),
                   "model": model.name, "global_batch_size": gbs, "load_before": load()}
            row.update(joint(model, cluster, gbs))
            parts: dict = {}
            share, same = alone(model, cluster, gbs, parts)
            row.update({"alone_peak_share_tokens_per_s": share, "alone_same_batch_tokens_per_s": same,
                        "alone_same_batch_breakdown": parts,
                        "upper_bound_peak_share": sum(share.values()), "upper_bound_same_batch": sum(same.values())})
            row["ratio_peak_share"] = row["chosen_tokens_per_s"] / row["upper_bound_peak_share"]
            row["ratio_same_batch"] = row["chosen_tokens_per_s"] / row["upper_bound_same_batch"]
            row.update(gap(model, cluster, gbs, row))
            rows.append(row)
            print(f"{name[:-5]:<24} {model.name:<11} {row['chosen_tokens_per_s']:>12.4g} "
                  f"{row['upper_bound_same_batch']:>10.4g} {row['ratio_same_batch']:>6.3f} "
                  f"{row['upper_bound_peak_share']:>10.4g} {row['ratio_peak_share']:>6.3f} "
                  f"{row['gpus_used']:>4}/{row['gpus']:<4} {str(row['idle_explained']):>9} "
                  f"{row['planning_time_s']:>6.1f} {row['planning_cpu_s']:>6.1f}")
            c = row["chosen_breakdown"]
            print(f"    chosen: pipeline {c['pipeline_s']:.3f} s + reduction {c['gradient_reduction_s']:.3f} s + optimizer "
                  f"{c['optimizer_s']:.3f} s, {c['sequences_per_gpu']} sequences/GPU; fluid ceiling / same-batch bound "
                  f"{row['fluid_over_same_batch_bound']:.3f}")
            for island_name, a in row["alone_same_batch_breakdown"].items():
                print(f"    alone {island_name}: pipeline {a['pipeline_s']:.3f} s + reduction {a['gradient_reduction_s']:.3f} s, "
                      f"{a['sequences_per_gpu']} sequences/GPU")
            if row["miss_reason"]:
                print(f"    miss: {row['miss_reason']}")
            for line in row["idle_explanations"]:
                print(f"    {line[:150]}")
    return rows


def pair_cases(models: list[ModelSpec]) -> list[dict]:
    figures = []
    print(f"{'devices':<22} {'model':<11} {'chosen tok/s':>12} {'upper':>10} {'ratio':>6} {'uniform':>10} "
          f"{'x_unif':>6} {'fastest':>10} {'x_fast':>6} {'plan_s':>6}")
    for a, b in PAIRS:
        cluster = cluster_of(a, b)
        for model in models:
            t0 = time.perf_counter()
            chosen = plan_cluster(model, cluster, global_batch_size=GLOBAL_BATCH).candidates[0][1].tokens_per_s
            elapsed = time.perf_counter() - t0
            share, same = alone(model, cluster, GLOBAL_BATCH)
            upper = sum(share.values())
            fastest_island = max(cluster.islands, key=lambda i: (i.device.peak_tflops, i.num_gpus))
            fastest = share[fastest_island.name]
            uniform = uniform_baseline(model, cluster)
            row = {"devices": f"{GPUS_PER_ISLAND[0]}x{a}+{GPUS_PER_ISLAND[1]}x{b}", "model": model.name,
                   "chosen_tokens_per_s": chosen, "upper_bound_tokens_per_s": upper, "ratio_to_upper": chosen / upper,
                   "alone_tokens_per_s": share, "upper_bound_same_batch": sum(same.values()),
                   "ratio_same_batch": chosen / sum(same.values()), "uniform_tokens_per_s": uniform,
                   "speedup_over_uniform": chosen / uniform if uniform else None,
                   "fastest_only_tokens_per_s": fastest, "speedup_over_fastest_only": chosen / fastest if fastest else None,
                   "planning_time_s": round(elapsed, 2)}
            figures.append(row)
            fmt = lambda x: f"{x:6.2f}" if x else "   n/a"  # noqa: E731
            print(f"{a + '+' + b:<22} {model.name:<11} {chosen:>12.4g} {upper:>10.4g} {chosen / upper:>6.3f} "
                  f"{uniform:>10.4g} {fmt(row['speedup_over_uniform'])} {fastest:>10.4g} "
                  f"{fmt(row['speedup_over_fastest_only'])} {elapsed:>6.1f}")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the 1,024-GPU case of issue #19 (llama2-7b)")
    args = parser.parse_args(argv)
    models = [load_model(ROOT / "examples/models/llama2-7b.yaml"), load_model(ROOT / "examples/models/llama2-70b.yaml")]
    start = time.perf_counter()
    if args.quick:
        multi = multi_cases(models[:1], names=MULTI[:1])
        pairs = []
    else:
        multi = multi_cases(models)
        pairs = pair_cases(models)
    multi_min = min(r["ratio_peak_share"] for r in multi)
    multi_same_min = min(r["ratio_same_batch"] for r in multi)
    pair_min = min((r["ratio_to_upper"] for r in pairs), default=None)
    print(f"three+ types: min ratio {multi_min:.3f} (peak-share bound), {multi_same_min:.3f} (same-batch bound); "
          f"idle explained everywhere: {all(r['idle_explained'] for r in multi)}")
    if pairs:
        print(f"pairs: min ratio {pair_min:.3f}; {sum(r['ratio_to_upper'] >= TARGET for r in pairs)}/{len(pairs)} >= 0.95")
    out = {"multi_type": multi, "figures": pairs,
           "targets": {"ratio_min": TARGET,
                       "multi_type_min_ratio_peak_share": multi_min, "multi_type_min_ratio_same_batch": multi_same_min,
                       "multi_type_met_peak_share": multi_min >= TARGET, "multi_type_met_same_batch": multi_same_min >= TARGET,
                       "multi_type_cases_met_same_batch": sum(r["ratio_same_batch"] >= TARGET for r in multi),
                       "multi_type_cases_met_peak_share": sum(r["ratio_peak_share"] >= TARGET for r in multi),
                       "multi_type_cases": len(multi),
                       "idle_explained": all(r["idle_explained"] for r in multi),
                       "pairs_min_ratio": pair_min, "pairs_met": pair_min is not None and pair_min >= TARGET},
           "load_after": load(), "bench_wall_s": round(time.perf_counter() - start, 1), **stamp()}
    name = "planner_efficiency_quick.json" if args.quick else "planner_efficiency.json"
    write_result(name, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
