"""Fast planner vs exhaustive search on generated small clusters (<= 32 GPUs, 2-3 device types).

    python bench/planner_optimality.py

Gap = fast plan's predicted iteration time / exhaustive best - 1 (both under the same
performance model). Both search compositions of replicas of different shapes over the islands
(planner/compose.py); the exhaustive one with every TP size in every chain, every (micro-batch
size, recompute) setting, every pair of the 12 best shapes at every count, and idle GPUs filled
with every shape. Target: within 1%. Writes bench/results/planner_optimality.json.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from harness import ROOT, stamp, write_result

from megatron_het.cluster import CATALOG, ClusterSpec, IslandSpec, LinkSpec, ModelSpec, load_model
from megatron_het.planner import InfeasibleError, plan_cluster

TYPES = ("V100-32GB", "A100-40GB", "A100-80GB", "H100-SXM", "L40S", "MI250X", "MI300X", "RTX-4090")
CASES = 24


def models() -> list[ModelSpec]:
    small = ModelSpec(num_layers=12, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=32000,
                      swiglu=True, ffn_hidden_size=5504, num_query_groups=16, name="llama-1b-like")
    return [load_model(ROOT / "examples/models/gpt3-1.3b.yaml"), load_model(ROOT / "examples/models/gpt3-2.7b.yaml"),
            load_model(ROOT / "examples/models/llama2-7b.yaml"), small]


def generated(rng: random.Random, k: int) -> ClusterSpec:
    kinds = rng.sample(TYPES, rng.choice((2, 3)))
    budget = 32
    islands = []
    for i, t in enumerate(kinds):
        gpn = rng.choice((2, 4, 8))
        nodes = rng.choice((1, 2))
        while gpn * nodes > budget - 2 * (len(kinds) - i - 1) and gpn > 1:
            gpn //= 2
        nodes = max(1, min(nodes, (budget - 2 * (len(kinds) - i - 1)) // gpn))
        budget -= gpn * nodes
        islands.append(IslandSpec(name=f"c{k}-{t.lower()}", device=CATALOG[t], nodes=nodes, gpus_per_node=gpn))
    links = tuple(LinkSpec(between=(a.name, b.name), bandwidth_gbps=rng.choice((25.0, 100.0, 200.0)))
                  for i, a in enumerate(islands) for b in islands[i + 1:])
    return ClusterSpec(islands=tuple(islands), links=links)


def main() -> int:
    rng = random.Random(20240601)
    ms = models()
    figures = []
    print(f"{'case':>4} {'GPUs':>4} {'types':<32} {'model':<14} {'gbs':>4} {'fast_s':>9} {'exh_s':>9} {'gap_%':>6} "
          f"{'t_fast':>6} {'t_exh':>6}")
    while len(figures) < CASES:
        k = len(figures)
        cluster = generated(rng, k)
        model = ms[k % len(ms)]
        gbs = rng.choice((32, 64, 128))
        try:
            t0 = time.perf_counter()
            fast = plan_cluster(model, cluster, global_batch_size=gbs)
            t1 = time.perf_counter()
            full = plan_cluster(model, cluster, global_batch_size=gbs, exhaustive=True)
            t2 = time.perf_counter()
        except InfeasibleError:
            continue  # generated cluster too small for the model: draw another
        f, e = fast.candidates[0][1].iteration_time_s, full.candidates[0][1].iteration_time_s
        shapes = lambda r: len({tuple((s.island, s.tp) for s in rep.stages) for rep in r.best.replicas})  # noqa: E731
        gap = 100 * (f / e - 1)
        kinds = "+".join(f"{i.num_gpus}x{i.device.name}" for i in cluster.islands)
        figures.append({"case": k, "gpus": cluster.num_gpus, "islands": kinds, "model": model.name,
                        "global_batch_size": gbs, "fast_iteration_s": f, "exhaustive_iteration_s": e,
                        "gap_percent": gap, "fast_time_s": t1 - t0, "exhaustive_time_s": t2 - t1,
                        "fast_replica_shapes": shapes(fast), "exhaustive_replica_shapes": shapes(full)})
        print(f"{k:>4} {cluster.num_gpus:>4} {kinds:<32} {model.name:<14} {gbs:>4} {f:>9.4g} {e:>9.4g} {gap:>6.2f} "
              f"{t1 - t0:>6.2f} {t2 - t1:>6.2f}")
    gaps = [x["gap_percent"] for x in figures]
    summary = {"cases": len(gaps), "worst_gap_percent": max(gaps), "median_gap_percent": statistics.median(gaps),
               "within_1_percent": sum(g <= 1.0 for g in gaps)}
    print(f"worst gap {summary['worst_gap_percent']:.3f}%, median {summary['median_gap_percent']:.3f}%, "
          f"{summary['within_1_percent']}/{len(gaps)} within 1%")
    out = {"figures": {"cases": figures, "summary": summary},
           "targets": {"gap_percent_max": 1.0, "met": summary["worst_gap_percent"] <= 1.0}, **stamp()}
    write_result("planner_optimality.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
