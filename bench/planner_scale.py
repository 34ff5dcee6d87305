"""Planning time vs cluster size: 64, 1,024, 4,096 and 16,384 GPUs of three device types
(llama2-70b), and issue #19's 1,024-GPU case (llama2-7b on examples/clusters/tangram-1024.yaml),
with composition over islands on (the default).

    python bench/planner_scale.py

Targets: <= 10 s at 1,024 GPUs and <= 60 s at 16,384 (one core; the planner is single-threaded).
The machine is shared: wall and CPU time (time.process_time) are both recorded, with the load
average before each case. Writes bench/results/planner_scale.json.
"""

from __future__ import annotations

import os
import sys
import time

from harness import ROOT, stamp, write_result

from megatron_het.cluster import CATALOG, ClusterSpec, IslandSpec, LinkSpec, load_cluster, load_model
from megatron_het.planner import describe_plan, plan_cluster

TYPES = ("A100-80GB", "H100-SXM", "MI250X")
SIZES = (64, 1024, 4096, 16384)


def cluster_of(gpus: int) -> ClusterSpec:
    nodes = gpus // 8
    split = [nodes // 3, nodes // 3, nodes - 2 * (nodes // 3)]
    islands = tuple(IslandSpec(name=f"{t.lower()}-pod", device=CATALOG[t], nodes=n, gpus_per_node=8,
                               inter_node_bandwidth_gbps=200.0) for t, n in zip(TYPES, split))
    links = tuple(LinkSpec(between=(a.name, b.name), bandwidth_gbps=100.0)
                  for i, a in enumerate(islands) for b in islands[i + 1:])
    return ClusterSpec(islands=islands, links=links)


def run(label: str, model, cluster: ClusterSpec, gbs: int) -> dict:
    load = os.getloadavg()
    start, cpu = time.perf_counter(), time.process_time()
    result = plan_cluster(model, cluster, global_batch_size=gbs)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu  # CPU: robust to a loaded machine
    pred = result.candidates[0][1]
    desc = describe_plan(result.best).replace("\n", "; ")
    row = {"case": label, "gpus": cluster.num_gpus, "model": model.name,
           "device_types": [i.device.name for i in cluster.islands], "global_batch_size": gbs,
           "planning_time_s": round(elapsed, 3), "planning_cpu_s": round(cpu, 3), "load_before": load,
           "tokens_per_s": pred.tokens_per_s, "gpus_used": pred.num_gpus, "best": desc}
    print(f"{label:<14} {cluster.num_gpus:>6} {gbs:>5} {elapsed:>8.2f} {cpu:>7.2f} {pred.tokens_per_s:>10.4g} "
          f"{pred.num_gpus:>9}  {desc[:80]}")
    return row


def main() -> int:
    model = load_model(ROOT / "examples/models/llama2-70b.yaml")
    print(f"{'case':<14} {'GPUs':>6} {'gbs':>5} {'plan_s':>8} {'cpu_s':>7} {'tokens/s':>10} {'GPUs used':>9}  best")
    figures = [run(f"70b-{gpus}", model, cluster_of(gpus), max(1024, gpus // 4)) for gpus in SIZES]
    issue = run("issue19-7b", load_model(ROOT / "examples/models/llama2-7b.yaml"),
                load_cluster(ROOT / "examples/clusters/tangram-1024.yaml"), 2048)
    at = {f["gpus"]: f for f in figures}
    out = {"figures": figures, "issue_case": issue,
           "targets": {"planning_time_s_at_1024": 10.0, "planning_time_s_at_16384": 60.0,
                       "met": {"1024": at[1024]["planning_time_s"] <= 10.0,
                               "issue19_1024": issue["planning_time_s"] <= 10.0,
                               "16384": at[16384]["planning_time_s"] <= 60.0}}, **stamp()}
    write_result("planner_scale.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
