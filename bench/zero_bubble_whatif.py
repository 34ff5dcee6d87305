"""What a schedule without any bubble would give the planner's llama2-7b plans of
bench/planner_efficiency.py (issue #19's six multi-type clusters, its same-batch upper bounds).

    python bench/zero_bubble_whatif.py        # ~1-2 min: plans the six 7B cases again

For each case, the plan the planner chooses today is priced as it is (``perf.predict``) and as if its
schedule had no bubble and no transfer waits: the busiest stage's compute
(``StagePrediction.compute_s``, forwards + backwards of all its micro-batches) plus what the iteration
spends past its slowest pipeline (exposed gradient reduction, synchronisation, optimizer step). Same
plan, same bound (bench/results/planner_efficiency.json's ``upper_bound_same_batch``): it says whether
a zero-bubble schedule (e.g. a V-shaped one) alone could reach issue #19's 0.95.

A plan chosen under today's schedules need not be the best one without a bubble: deeper pipelines
and replicas over every island cost fill that a bubble-free schedule would not charge. So the search
is run again with every replica priced without fill (``Estimator(fill_free=True)``: m micro-batches
take m steady periods; memory as under 1F1B), and the fastest layout it finds is priced the same way
as the first column (busiest stage's compute + past the pipeline, ``perf.predict``). No schedule the
runtime runs, nor ZB-V, is fill-free (the last stage starts one forward per stage late), so this is an
optimistic what-if of the model, not a measurement. Writes bench/results/zero_bubble_whatif.json.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

from harness import ROOT, stamp, write_result

from megatron_het.cluster import load_cluster, load_model
from megatron_het.perf.predict import predict
from megatron_het.planner import plan_cluster
from megatron_het.planner import search as planner_search
from megatron_het.planner.estimate import Estimate, Estimator
from megatron_het.planner.space import build_plan

TARGET = 0.95


@contextlib.contextmanager
def fill_free_search(seen: list[Estimate]):
    """plan_cluster's search with every point priced without pipeline fill; each point priced is
    appended to ``seen`` (plan_cluster's own ranking still predicts with real schedules: not used)."""

    class FillFree(Estimator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, fill_free=True, **kwargs)

        def evaluate(self, templates, mbs, recompute):
            e = super().evaluate(templates, mbs, recompute)
            if not isinstance(e, str):
                seen.append(e)
            return e

    real = planner_search.Estimator
    planner_search.Estimator = FillFree
    try:
        yield
    finally:
        planner_search.Estimator = real


def bubble_free_s(plan, model, cluster) -> tuple[float, object, float]:
    """A plan's iteration without bubble or transfer waits (the first column's figure), its
    prediction and its busiest stage's compute."""
    pred = predict(plan, model, cluster)
    busiest = max(s.compute_s for r in pred.replicas for s in r.stages)
    return busiest + pred.iteration_time_s - pred.pipeline_time_s, pred, busiest


def best_fill_free(model, cluster, gbs: int) -> dict:
    """The fastest layout of a fill-free search, priced as bubble-free by perf.predict."""
    seen: list[Estimate] = []
    t0 = time.perf_counter()
    with fill_free_search(seen):
        plan_cluster(model, cluster, global_batch_size=gbs)
    ranked = sorted(seen, key=lambda e: min(e.iteration_time_s, e.zb_iteration_time_s))
    best = None
    for e in ranked[:20]:  # the estimate's best 20 (a heuristic, not exhaustive), re-priced in full, memory checked
        plan = build_plan(cluster, e.templates, e.layer_counts, e.micro_batches, micro_batch_size=e.micro_batch_size,
                          global_batch_size=gbs, recompute=e.recompute, distributed_optimizer=True,
                          stage_recompute=e.stage_recompute)
        t, pred, busiest = bubble_free_s(plan, model, cluster)
        if pred.fits and (best is None or t < best[0]):
            best = (t, plan, e, busiest)
    if best is None:  # the estimate's best layouts all exceed memory in full: say so, no figure
        return {"bubble_free_s": float("inf"), "busiest_stage_compute_s": None, "past_pipeline_s": None,
                "estimate_s": None, "gpus_used": {}, "layouts": {}, "micro_batch_size": None,
                "search_wall_s": time.perf_counter() - t0, "note": "none of the 20 best estimates fits memory"}
    t, plan, e, busiest = best
    used, shapes = plan_layouts(plan)
    return {"bubble_free_s": t, "busiest_stage_compute_s": busiest, "past_pipeline_s": t - busiest,
            "estimate_s": min(e.iteration_time_s, e.zb_iteration_time_s),
            "gpus_used": used, "layouts": shapes, "micro_batch_size": plan.micro_batch_size,
            "search_wall_s": time.perf_counter() - t0}


def plan_layouts(plan, gpus_per_rank=None) -> tuple[dict[str, int], dict[str, int]]:
    """(GPUs used per island, replica layout -> how many replicas have it) of ``plan``;
    ``gpus_per_rank``: island -> GPUs each of its ranks stands for (None: 1)."""
    used: dict[str, int] = {}
    shapes: dict[str, int] = {}
    for r in plan.replicas:
        for st in r.stages:
            used[st.island] = used.get(st.island, 0) + st.tp * (gpus_per_rank or {}).get(st.island, 1)
        key = " | ".join(f"{st.island.removesuffix('-pod')} TP={st.tp}" for st in r.stages)
        shapes[key] = shapes.get(key, 0) + 1
    return used, shapes


def main() -> int:
    efficiency = json.loads((ROOT / "bench/results/planner_efficiency.json").read_text())
    model = load_model(ROOT / "examples/models/llama2-7b.yaml")
    rows = []
    print(f"{'cluster':20s} {'schedule':8s} {'bubble':>7s} {'ratio now':>10s} {'bubble-free':>12s} "
          f"{'fill-free search':>17s}  layouts of the fill-free search")
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
        ff = best_fill_free(model, cluster, case["global_batch_size"])
        row = {"cluster": case["cluster"], "schedule": plan.schedule, "replicas": len(plan.replicas),
               "iteration_s": pred.iteration_time_s, "busiest_stage_compute_s": busiest,
               "past_pipeline_s": past_pipeline,
               "bubble_fraction_max": max(r.bubble_fraction for r in pred.replicas),
               "ratio_same_batch": tokens / pred.iteration_time_s / bound,
               "ratio_bubble_free": tokens / (busiest + past_pipeline) / bound,
               "fill_free_search": ff, "ratio_fill_free_search": tokens / ff["bubble_free_s"] / bound,
               # every GPU at its island's best rate, the batch split continuously (planner/gap.py)
               "fluid_s": tokens / case["fluid_tokens_per_s"]}
        rows.append(row)
        print(f"{row['cluster']:20s} {row['schedule']:8s} {row['bubble_fraction_max']:7.1%} "
              f"{row['ratio_same_batch']:10.3f} {row['ratio_bubble_free']:12.3f} {row['ratio_fill_free_search']:17.3f}  "
              + ", ".join(f"{n} x [{k}]" for k, n in ff["layouts"].items()), flush=True)
    met = sum(r["ratio_bubble_free"] >= TARGET for r in rows)
    met_search = sum(r["ratio_fill_free_search"] >= TARGET for r in rows)
    print(f"bubble-free plans at >= {TARGET}: {met}/{len(rows)}; fill-free search: {met_search}/{len(rows)}")
    write_result("zero_bubble_whatif.json", {
        "benchmark": "zero_bubble_whatif", **stamp(),
        "bounds_from": "bench/results/planner_efficiency.json (" + efficiency.get("date", "?") + ")",
        "targets": {"ratio_same_batch": TARGET}, "figures": {"cases": rows, "bubble_free_at_target": met,
                                                    "fill_free_search_at_target": met_search}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
