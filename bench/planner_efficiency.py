#!/usr/bin/env python
"""Heterogeneous plan throughput vs its upper bound and two baselines, six device pairs x two models.

    python bench/planner_efficiency.py

Upper bound: sum over the islands of the best plan found by the same planner on that island
alone, each island running its share of the global batch (in proportion to its peak TFLOP/s), so
per-replica micro-batch counts are comparable with the joint run. Baselines: Megatron's uniform plan on the whole cluster (same TP/PP everywhere, equal
layers, equal micro-batches per replica; the best such plan that fits) and the fastest device
type alone. Target: chosen / upper bound >= 0.95 everywhere. Writes bench/results/planner_efficiency.json.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from megatron_het.cluster import CATALOG, ClusterSpec, IslandSpec, LinkSpec, ModelSpec, load_model  # noqa: E402
from megatron_het.perf import predict  # noqa: E402
from megatron_het.plan import PlanError, validate_plan  # noqa: E402
from megatron_het.planner import InfeasibleError, Segment, Template, build_plan, plan_cluster, tp_options  # noqa: E402

PAIRS = (("A100-80GB", "H100-SXM"), ("A100-80GB", "MI250X"), ("H100-SXM", "MI300X"), ("V100-32GB", "A100-80GB"),
         ("A100-80GB", "L40S"), ("H100-SXM", "H200"))
GPUS_PER_ISLAND = (128, 64)  # first type, second type
GLOBAL_BATCH = 1024


def machine() -> dict:
    return {"cpu_count": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


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


def main() -> int:
    models = [load_model(ROOT / "examples/models/llama2-7b.yaml"), load_model(ROOT / "examples/models/llama2-70b.yaml")]
    figures = []
    print(f"{'devices':<22} {'model':<11} {'chosen tok/s':>12} {'upper':>10} {'ratio':>6} {'uniform':>10} "
          f"{'x_unif':>6} {'fastest':>10} {'x_fast':>6} {'plan_s':>6}")
    for a, b in PAIRS:
        cluster = cluster_of(a, b)
        for model in models:
            t0 = time.perf_counter()
            chosen = plan_cluster(model, cluster, global_batch_size=GLOBAL_BATCH).candidates[0][1].tokens_per_s
            elapsed = time.perf_counter() - t0
            alone, peak = {}, sum(i.peak_tflops for i in cluster.islands)
            for island in cluster.islands:
                # The island's share of the global batch, in proportion to its peak (multiple of 8).
                share = max(8, round(GLOBAL_BATCH * island.peak_tflops / peak / 8) * 8)
                try:
                    alone[island.name] = plan_cluster(model, cluster, global_batch_size=share,
                                                      islands=[island.name]).candidates[0][1].tokens_per_s
                except InfeasibleError:
                    alone[island.name] = 0.0
            upper = sum(alone.values())
            fastest_island = max(cluster.islands, key=lambda i: (i.device.peak_tflops, i.num_gpus))
            fastest = alone[fastest_island.name]
            uniform = uniform_baseline(model, cluster)
            row = {"devices": f"{GPUS_PER_ISLAND[0]}x{a}+{GPUS_PER_ISLAND[1]}x{b}", "model": model.name,
                   "chosen_tokens_per_s": chosen, "upper_bound_tokens_per_s": upper, "ratio_to_upper": chosen / upper,
                   "alone_tokens_per_s": alone, "uniform_tokens_per_s": uniform,
                   "speedup_over_uniform": chosen / uniform if uniform else None,
                   "fastest_only_tokens_per_s": fastest, "speedup_over_fastest_only": chosen / fastest if fastest else None,
                   "planning_time_s": round(elapsed, 2)}
            figures.append(row)
            fmt = lambda x: f"{x:6.2f}" if x else "   n/a"  # noqa: E731
            print(f"{a + '+' + b:<22} {model.name:<11} {chosen:>12.4g} {upper:>10.4g} {chosen / upper:>6.3f} "
                  f"{uniform:>10.4g} {fmt(row['speedup_over_uniform'])} {fastest:>10.4g} "
                  f"{fmt(row['speedup_over_fastest_only'])} {elapsed:>6.1f}")
    ratios = [f["ratio_to_upper"] for f in figures]
    print(f"min ratio to upper bound {min(ratios):.3f}; {sum(r >= 0.95 for r in ratios)}/{len(ratios)} >= 0.95")
    out = {"figures": figures,
           "targets": {"ratio_to_upper_min": 0.95, "met": min(ratios) >= 0.95, "min_ratio": min(ratios)},
           "command": "python bench/planner_efficiency.py", "machine": machine(),
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    (ROOT / "bench/results/planner_efficiency.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
