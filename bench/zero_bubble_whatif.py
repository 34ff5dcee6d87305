#!/usr/bin/env python
"""What a schedule without any bubble would give the planner's llama2-7b plans of
bench/planner_efficiency.py (issue #19's six multi-type clusters, its same-batch upper bounds).

    python bench/zero_bubble_whatif.py        # ~1-2 min: plans the six 7B cases again

For each case, the plan the planner chooses today is priced as it is (``perf.predict``) and as if its
schedule had no bubble and no transfer waits: the busiest stage's compute
(``StagePrediction.compute_s``, forwards + backwards of all its micro-batches) plus what the iteration
spends past its slowest pipeline (exposed gradient reduction, synchronisation, optimizer step). Same
plan, same bound (bench/results/planner_efficiency.json's ``upper_bound_same_batch``): it says whether
a zero-bubble schedule (e.g. a V-shaped one) alone could reach issue #19's 0.95. A what-if of the
model, not a measurement. Writes bench/results/zero_bubble_whatif.json.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from bench_record import machine, perf_commit, write_result  # noqa: E402

from megatron_het.cluster import load_cluster, load_model  # noqa: E402
from megatron_het.perf.predict import predict  # noqa: E402
from megatron_het.planner import plan_cluster  # noqa: E402

TARGET = 0.95


def main() -> int:
    efficiency = json.loads((ROOT / "bench/results/planner_efficiency.json").read_text())
    model = load_model(ROOT / "examples/models/llama2-7b.yaml")
    rows = []
    print(f"{'cluster':20s} {'schedule':8s} {'bubble':>7s} {'ratio now':>10s} {'bubble-free':>12s}")
    for case in efficiency["multi_type"]:
        if case["model"] != "llama2-7b":
            continue
        cluster = load_cluster(ROOT / "examples/clusters" / case["cluster"])
        plan = plan_cluster(model, cluster, global_batch_size=case["global_batch_size"]).best
        pred = predict(plan, model, cluster)
        busiest = max(s.compute_s for r in pred.replicas for s in r.stages)
        past_pipeline = pred.iteration_time_s - pred.pipeline_time_s
        tokens = case["global_batch_size"] * model.seq_length
        bound = case["upper_bound_same_batch"]
        row = {"cluster": case["cluster"], "schedule": plan.schedule, "replicas": len(plan.replicas),
               "iteration_s": pred.iteration_time_s, "busiest_stage_compute_s": busiest,
               "past_pipeline_s": past_pipeline,
               "bubble_fraction_max": max(r.bubble_fraction for r in pred.replicas),
               "ratio_same_batch": tokens / pred.iteration_time_s / bound,
               "ratio_bubble_free": tokens / (busiest + past_pipeline) / bound}
        rows.append(row)
        print(f"{row['cluster']:20s} {row['schedule']:8s} {row['bubble_fraction_max']:7.1%} "
              f"{row['ratio_same_batch']:10.3f} {row['ratio_bubble_free']:12.3f}")
    met = sum(r["ratio_bubble_free"] >= TARGET for r in rows)
    print(f"bubble-free plans at >= {TARGET}: {met}/{len(rows)}")
    write_result("zero_bubble_whatif.json", {
        "benchmark": "zero_bubble_whatif", "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "command": "python bench/zero_bubble_whatif.py", "machine": machine(), "perf_commit": perf_commit(),
        "bounds_from": "bench/results/planner_efficiency.json (" + efficiency.get("date", "?") + ")",
        "targets": {"ratio_same_batch": TARGET}, "figures": {"cases": rows, "bubble_free_at_target": met}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
