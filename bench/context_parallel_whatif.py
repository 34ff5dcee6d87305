"""What context parallelism could give issue #19's llama2-7b cases: an optimistic what-if of the model.

    python bench/context_parallel_whatif.py        # ~6 min: plans the six 7B cases, CP 2 and 4 on all or the slower islands

The 7B cases miss 0.95 of the same-batch bound on whole sequences (2 per GPU on issue #19's cluster)
and whole layers per stage; even a schedule without any pipeline fill does not reach it there
(bench/zero_bubble_whatif.py). Context parallelism (CP) splits each sequence over ``c`` GPUs, so
finer work per GPU. Neither the runtime nor the predictor has it (no issue names it), so this prices
it the cheapest way it could go: every ``c`` GPUs of an island become one device with ``c`` times the
compute, memory bandwidth and memory (a sequence's GEMMs and its load-balanced causal attention
split evenly, with **no** key/value exchange, GEMMs tiled as one GPU's over the whole sequence,
and memory as if weights were not replicated), with ``c`` GPUs' links (inside the node, to other
nodes, across islands). A node then moves what it moves without CP: its GPUs hold the same parameters
(their gradients are reduced over data x context parallel ranks) and each carries 1/c of every
activation; where the predictor's reduction is not hierarchical, ``c`` links flatter CP further. The planner then searches
that cluster as it is (real schedules, ``perf.predict``), and its throughput is compared with the
same-batch bound of bench/results/planner_efficiency.json (without CP: the real bound with CP allowed
is at least that, so this ratio is an upper estimate; the ratio against the bound raised where an
island alone gains from the same optimistic CP is printed beside it). A miss here is a miss with CP.
Writes bench/results/context_parallel_whatif.json.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

from harness import ROOT, stamp, write_result
from zero_bubble_whatif import best_fill_free, plan_layouts

from megatron_het.cluster import ClusterSpec, load_cluster, load_model
from megatron_het.planner import plan_cluster
from megatron_het.planner.errors import InfeasibleError

TARGET = 0.95
CP_SIZES = (2, 4)


def fused(cluster: ClusterSpec, cp: int | dict[str, int]) -> ClusterSpec:
    """Every ``c`` GPUs of each island as one device ``c`` times as fast and as large (see the docstring);
    ``cp``: one size for every island, or a size per island name (missing: 1)."""
    islands = []
    for isl in cluster.islands:
        c = cp if isinstance(cp, int) else cp.get(isl.name, 1)
        if isl.gpus_per_node % c:
            raise ValueError(f"island {isl.name}: {isl.gpus_per_node} GPUs per node do not split into CP groups "
                             f"of {c}. Fix: use a CP size dividing {isl.gpus_per_node}")
        d = isl.device
        # SMs kept per GPU: a fused device's GEMMs then tile as one GPU's over the whole sequence, at
        # least as well as each real GPU's over its 1/c (weight gradients keep their tile count)
        dev = replace(d, peak_tflops=d.peak_tflops * c, memory_gib=d.memory_gib * c,
                      memory_bandwidth_gbs=d.memory_bandwidth_gbs * c,
                      tflops=tuple((k, v * c) for k, v in dict(d.tflops).items()))
        # c GPUs' network ports: a node moves what it moved before (each of its GPUs holds the same
        # parameters with or without CP, and carries 1/c of each activation)
        islands.append(replace(isl, device=dev, gpus_per_node=isl.gpus_per_node // c,
                               inter_node_bandwidth_gbps=isl.inter_node_bandwidth_gbps * c,
                               intra_node_bandwidth_gbps=isl.intra_node_bandwidth_gbps * c))
    # Across islands: the slower end's group size times the per-GPU link.
    size = {i.name: (cp if isinstance(cp, int) else cp.get(i.name, 1)) for i in cluster.islands}
    links = tuple(replace(k, bandwidth_gbps=k.bandwidth_gbps * min(size[k.between[0]], size[k.between[1]]))
                  for k in cluster.links)
    return replace(cluster, islands=tuple(islands), links=links)


def tokens_per_s(model, cluster, gbs: int, islands=None) -> tuple[float, object]:
    plan = plan_cluster(model, cluster, global_batch_size=gbs, islands=islands).best
    return gbs * model.seq_length / plan.predicted["iteration_time_s"], plan


def variants(cluster: ClusterSpec) -> list[tuple[str, dict[str, int]]]:
    """CP sizes per island tried: every island at 2 and 4, and only the islands slower than the
    fastest type (finer work where one sequence takes longest) at 2 and 4."""
    top = max(i.device.peak_tflops for i in cluster.islands)
    slow = [i.name for i in cluster.islands if i.device.peak_tflops < top]
    out = [(f"all CP {c}", {i.name: c for i in cluster.islands}) for c in CP_SIZES]
    return out + [(f"slower CP {c}", {n: c for n in slow}) for c in CP_SIZES]


def main() -> int:
    efficiency = json.loads((ROOT / "bench/results/planner_efficiency.json").read_text())
    model = load_model(ROOT / "examples/models/llama2-7b.yaml")
    rows = []
    print(f"{'cluster':22s} {'variant':14s} {'ratio':>6s} {'vs CP bound':>11s} {'no CP':>6s} {'GPUs used':>10s}  layouts",
          flush=True)
    for case in efficiency["multi_type"]:
        if case["model"] != "llama2-7b":
            continue
        base = load_cluster(ROOT / "examples/clusters" / case["cluster"])
        gbs = case["global_batch_size"]
        alone = dict(case["alone_same_batch_tokens_per_s"])
        for label, cp in variants(base):
            t0 = time.perf_counter()
            cl = fused(base, cp)
            bound_parts = {}
            for isl in cl.islands:
                with_cp = 0.0
                if cp.get(isl.name, 1) > 1:  # the bound may use CP too
                    try:
                        with_cp, _ = tokens_per_s(model, cl, gbs, islands=[isl.name])
                    except InfeasibleError:
                        pass
                bound_parts[isl.name] = max(alone.get(isl.name, 0.0), with_cp)
            bound = sum(bound_parts.values())
            tps, plan = tokens_per_s(model, cl, gbs)
            used, shapes = plan_layouts(plan, cp)  # a fused device stands for c GPUs
            row = {"cluster": case["cluster"], "variant": label, "cp": cp, "tokens_per_s": tps,
                   "bound_same_batch": bound, "bound_without_cp": case["upper_bound_same_batch"],
                   "bound_parts": bound_parts, "ratio_same_batch": tps / case["upper_bound_same_batch"],
                   "ratio_bound_with_cp": tps / bound,
                   "ratio_without_cp": case["ratio_same_batch"], "schedule": plan.schedule, "gpus_used": used,
                   "gpus": case["gpus"], "layouts": shapes, "wall_s": time.perf_counter() - t0}
            rows.append(row)
            print(f"{case['cluster']:22s} {label:14s} {row['ratio_same_batch']:6.3f} {row['ratio_bound_with_cp']:11.3f} "
                  f"{case['ratio_same_batch']:6.3f} "
                  f"{sum(used.values()):10d}  " + ", ".join(f"{n} x [{k}]" for k, n in shapes.items())[:140],
                  flush=True)
    # Issue #19's own case with both what-ifs at once: CP (as above) and a schedule without fill
    # (bench/zero_bubble_whatif.py's search), against the bound without CP.
    tangram = next(c for c in efficiency["multi_type"] if c["model"] == "llama2-7b"
                   and c["cluster"] == "tangram-1024.yaml")
    both = []
    for c in CP_SIZES:
        ff = best_fill_free(model, fused(load_cluster(ROOT / "examples/clusters/tangram-1024.yaml"), c),
                            tangram["global_batch_size"])
        ratio = tangram["global_batch_size"] * model.seq_length / ff["bubble_free_s"] / tangram["upper_bound_same_batch"]
        both.append({"cp": c, "ratio_same_batch": ratio, "layouts": ff["layouts"]})
        print(f"tangram-1024 with all CP {c} and no pipeline fill: {ratio:.3f} "
              + ", ".join(f"{n} x [{k}]" for k, n in ff["layouts"].items())[:120], flush=True)
    cases = sorted({r["cluster"] for r in rows})
    best = {c: max(r["ratio_same_batch"] for r in rows if r["cluster"] == c) for c in cases}
    met = sum(v >= TARGET for v in best.values())
    lifted = sum(best[c] > next(r["ratio_without_cp"] for r in rows if r["cluster"] == c) for c in cases)
    print(f"best CP variant at >= {TARGET}: {met}/{len(cases)}; above the plan without CP: {lifted}/{len(cases)}")
    write_result("context_parallel_whatif.json", {
        "benchmark": "context_parallel_whatif", **stamp(),
        "bounds_from": "bench/results/planner_efficiency.json (" + efficiency.get("date", "?") + ")",
        "targets": {"ratio_same_batch": TARGET},
        "figures": {"cases": rows, "best_per_case": best, "best_at_target": met, "best_above_no_cp": lifted,
                    "tangram_cp_and_fill_free": both}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
