"""Every benchmark in one command, then the table of their current figures against their targets.

    python bench/run_all.py                           # every bench below in turn, default mode (hours here); the table
    python bench/run_all.py --only memory,published   # those benches, then the table
    python bench/run_all.py --table-only              # the table from bench/results/ as it stands: runs nothing

The table is bench/README.md's: each row's figure, command and date come from the newest of its results files
(bench/results/NAME.json); nothing here measures or predicts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROWS: dict = {}  # bench name -> (label, target, results files, figure function)


def row(label: str, target: str, *files: str):
    """Register a bench: its table label, its target, its results files (default NAME.json; the newest counts) and
    the function of the results that returns (figure, met: True/False/None for no target, or a verdict string)."""
    def add(fn):
        ROWS[fn.__name__] = (label, target, files or (fn.__name__,), fn)
        return fn
    return add


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


@row("[runtime overhead](../docs/runtime.md)", ">= 0.97; > 1 (ideal 1.33)")
def runtime_overhead(d):
    r = d["figures"]["ratios"]
    a, p, q = r["runtime_vs_megatron_homogeneous"], r["pipeline_balanced_vs_equal"], r["dp_balanced_vs_equal"]
    return (f"runtime / plain megatron-core (TP2xPP2): **{a:.3f}**; speed-balanced / equal split on the emulated "
            f"1.0/2.0 cluster: pipeline **{p:.3f}**, DP **{q:.3f}**", a >= 0.97 and p > 1 and q > 1)


@row("[planner optimality](../docs/planner.md#optimality)", "<= 1% each")
def planner_optimality(d):
    s = d["figures"]["summary"]
    return (f"**{s['within_1_percent']}/{s['cases']}** generated clusters within 1% of exhaustive, worst "
            f"**{s['worst_gap_percent']:.3f}%**", d["targets"]["met"])


@row("[planner scale](../docs/planner.md#scale)", "<= 10 s at 1,024 GPUs, <= 60 s at 16,384 (wall)")
def planner_scale(d):
    at = {f["gpus"]: f for f in d["figures"]}
    cases = {"issue #19's 7B, 1,024 GPUs": d["issue_case"], "70B, 1,024": at[1024], "4,096": at[4096],
             "16,384": at[16384]}
    return ("planning CPU s (wall): " + ", ".join(f"{n} **{c['planning_cpu_s']:.1f}** ({c['planning_time_s']:.1f})"
                                                  for n, c in cases.items()), all(d["targets"]["met"].values()))


@row("[planner efficiency](../docs/planner.md#efficiency)", ">= 0.95 of each bound")
def planner_efficiency(d):
    t, n = d["targets"], d["targets"]["multi_type_cases"]
    issue = next(r for r in d["multi_type"] if r["cluster"] == "tangram-1024.yaml" and r["model"] == "llama2-7b")
    return (f"3-4 device types: **{t['multi_type_cases_met_same_batch']}/{n}** cases >= 0.95 of the same-batch bound "
            f"(min {t['multi_type_min_ratio_same_batch']:.3f}; issue #19's case {issue['ratio_same_batch']:.3f}), "
            f"{t['multi_type_cases_met_peak_share']}/{n} of the peak-share bound; pairs min **{t['pairs_min_ratio']:.3f}**",
            t["multi_type_met_same_batch"] and t["pairs_met"])


@row("[zero-bubble what-if (#19)](../docs/planner.md#what-if-no-bubble-or-context-parallelism)", "analysis of #19's 0.95")
def zero_bubble_whatif(d):
    f = d["figures"]
    issue = next(c for c in f["cases"] if c["cluster"] == "tangram-1024.yaml")
    return (f"the 7B plans priced without bubble: **{f['bubble_free_at_target']}/{len(f['cases'])}** reach 0.95; "
            f"planned again fill-free: **{f['fill_free_search_at_target']}/{len(f['cases'])}** (issue #19's case "
            f"{issue['ratio_fill_free_search']:.3f})", None)


@row("[context-parallel what-if (#19)](../docs/planner.md#what-if-no-bubble-or-context-parallelism)",
     "analysis of #19's 0.95")
def context_parallel_whatif(d):
    f = d["figures"]
    both = max(x["ratio_same_batch"] for x in f["tangram_cp_and_fill_free"])
    return (f"the 7B cases with CP 2/4 (optimistic): **{f['best_at_target']}/{len(f['best_per_case'])}** reach 0.95; "
            f"issue #19's case at most {f['best_per_case']['tangram-1024.yaml']:.3f}, {both:.3f} with the fill-free "
            "search too", None)


@row("[planner fidelity](../docs/planner.md#fidelity)", "median \\|error\\| <= 10%")
def fidelity(d):
    f = d["figures"]
    worst = max(f["relative_error"], key=lambda n: abs(f["relative_error"][n]))
    return (f"{len(f['measured_s'])} plans on CPU-emulated clusters: median \\|error\\| **{_pct(f['median_abs_error'])}**"
            f", worst {_pct(f['worst_abs_error'])} ({worst})", f["median_abs_error"] <= 0.10)


@row("[MoE fidelity (#37)](../docs/moe.md#the-performance-model)", "<= 15% each plan")
def moe(d):
    f = d["figures"]
    modelled = f.get("ep_plans_with_all_to_all_modelled", {})
    worst_modelled = max((abs(v["relative_error"]) for v in modelled.values()), default=None)
    return (f"{f['plans']} MoE plans (EP across islands, EP in TP, TP+SP, uneven PP/DP, the planner's) on CPU-emulated clusters: "
            f"**{f['within_target']}/{f['plans']}** within 15%, median \\|error\\| {_pct(f['median_abs_error'])}, "
            f"worst **{_pct(f['worst_abs_error'])}** ({f['worst_plan']})"
            + ("" if worst_modelled is None else f"; EP plans with the all-to-all modelled, not measured: worst "
                                                 f"{_pct(worst_modelled)}"), f["within_target"] == f["plans"])


@row("[published GPU runs](../docs/performance-model.md#calibration-on-published-runs-fitpy-toolscalibratepy-benchpublishedpy)",
     "median <= 10%, worst <= 25%, no uniform sign per source, orderings kept")
def published(d):
    s, missed = d["summary"], [k for k, ok in d["checks"].items() if not ok]
    uniform = [name for name, v in d["per_source"].items() if not v["mixed"]]
    missed = [f"one sign in {', '.join(uniform)}" if k == "no_uniform_sign_per_source" else k for k in missed]
    return (f"{s['rows']} published runs, {s['sources']} sources, each priced by a fit on the others: median "
            f"\\|error\\| **{_pct(s['median_abs_error'])}**, worst **{_pct(s['worst_abs_error'])}**",
            "not met: " + ", ".join(missed) if missed else True)


@row("[communicator](../docs/communicator.md#benchmark)", ">= 1.5x")
def communicator(d):
    rows = {k: max(c["rows"], key=lambda r: r["size_mib"]) for k, c in d["figures"]["configs"].items()}
    order = [k for k in ("2x4", "2x2", "4x2") if k in rows]
    met = [k for k in order if rows[k]["speedup_vs_flat_in_order"] >= 1.5]
    return (f"all-reduce of {rows[order[0]]['size_mib']} MiB over a 10x slower link ({', '.join(order)} islands x "
            "ranks), hierarchical vs flat ring in island order " + " / ".join(
                f"**{rows[k]['speedup_vs_flat_in_order']:.2f}x**" for k in order) + ", vs interleaved ring "
            + " / ".join(f"{rows[k]['speedup_vs_flat_interleaved']:.2f}x" for k in order),
            True if met == order else f"vs interleaved: met; vs in order: {', '.join(met) or 'none'} only")


@row("[overlap](../docs/overlap.md)", ">= 1.3x; Spearman >= 0.8 per shape")
def overlap(d):
    f, t = d["figures"], d["targets"]
    out = "1D TP layer " + " / ".join(f"**{v['speedup']:.2f}x**" for v in f["layers"].values()) + " (column / row)"
    if "tp3d" in f:
        out += (f"; 3D MLP, overlap alone {f['tp3d']['mlp']['gain_overlap_alone']:.2f}x; 4D model vs measured "
                f"collectives, Spearman per layer shape min **{f['tp3d']['ranking']['spearman_per_shape_min']:.3f}**")
    return out, t["met"] and t.get("spearman_met", True)


@row("[schedules](../docs/runtime.md#schedules)", "within 15% each; ranking as predicted; split <= 5%",
     "schedules", "schedules_inrun4")
def schedules(d):
    f, r = d["figures"], d["figures"]["measured_over_predicted"]
    return (f"measured / predicted 1F1B **{r['1f1b']:.3f}**, interleaved **{r['interleaved']:.3f}**, ZB-H1 "
            f"**{r['zb-h1']:.3f}**; bubble ranking {'as predicted' if d['met']['bubble_ranking'] else 'DIFFERENT'}; "
            f"B/W split overhead {100 * f['split_overhead']:+.1f}%", all(d["met"].values()))


@row("[resilience](../docs/resilience.md#benchmark)", "(d) > (a), (b) after 1 failure")
def resilience(d):
    f = {k[0]: v["measured"] for k, v in d["figures"]["fractions_of_failure_free_throughput"].items()
         if k.endswith("_1_failure") and k[1] == "_"}
    return (f"throughput / failure-free after 1 failure: (a) restart + re-plan {f['a']:.2f}, (b) drop replica "
            f"{f['b']:.2f}, (c) re-route {f['c']:.2f}, (d) re-route split + staggered **{f['d']:.2f}**",
            f["d"] > f["a"] and f["d"] > f["b"])


@row("[memory](../docs/performance-model.md#what-the-runtime-holds-predicted-exactly-rank_memory-benchmemorypy)",
     "each component <= 5%, held peak <= 10%, every phase's allocation peak <= 10%")
def memory(d):
    return (f"{len(d['rows'])} rank configurations, predicted vs held: worst component "
            f"**{_pct(d['worst_component_error'])}**, worst peak **{_pct(d['worst_peak_error'])}**; allocation peak "
            f"per phase (construction, forward/backward, reduce, step, save, load): worst "
            f"**{_pct(d['worst_phase_error'])}**",
            d["component_target_met"] and d["peak_target_met"] and d["phase_target_met"])


@row("[fresh start (#34)](../docs/runtime.md#numbers-and-tests)", "<= 1e-5, initial model identical, weight check agreed")
def fresh_start(d):
    rows = d["rows"]
    worst = max(r["worst_relative_loss_difference"] for r in rows)
    same = sum(r["initial_equals_seeded_model"] and r["weight_check_agreed"] for r in rows)
    return (f"{len(rows)} plans (TP2, PP2, DP2, TP2xPP2, TP4, PP4 uneven, 3D-TP, TP2->TP1 beside TP1, sharded) from the seed vs one "
            f"process: worst relative loss difference **{worst:.1e}**; initial model identical and weight check "
            f"agreed **{same}/{len(rows)}**", d["targets"]["met"])


@row("[Cephalo](../docs/sharding.md)", "sharded where only it fits; speed gain within 25% of calibrated")
def cephalo(d):
    e, m = d["figures"]["emulated"], d["figures"]["emulated"]["mode_choice"]
    only = next(v for k, v in d["figures"]["planner"]["mode_choice"].items() if k.startswith("fits only"))
    return (f"planner: {only['mode']} where only memory-proportional shards fit; emulated: sharded vs pipeline "
            f"measured {m['measured_gain_sharded_vs_pipeline']:.2f}x (predicted "
            f"{m['predicted_gain_sharded_vs_pipeline']:.2f}x); speed- vs equal batches measured "
            f"**{e['measured_gain']:.2f}x**, calibrated {e['calibrated_predicted_gain']:.2f}x",
            only["mode"] == "sharded" and abs(e["measured_gain"] / e["calibrated_predicted_gain"] - 1) <= 0.25)


@row("schedules: waits", "diagnostic")
def schedules_waits(d):
    return ("replay of the measured action durations / measured pipeline: " + ", ".join(
        f"{n} {v['median']['replay_measured_durations_s'] / v['median']['pipeline_s']:.3f}"
        for n, v in d["figures"].items()), None)


@row("schedules: per-rank CPU", "diagnostic")
def schedules_rank_cpu(d):
    r = d["figures"]["interleaved_over_1f1b_compute_cpu"]
    return f"interleaved / 1F1B compute CPU per rank {min(r):.3f}-{max(r):.3f}", None


@row("schedules: per-action cost", "diagnostic")
def schedules_isolated(d):
    f, r = d["figures"], d["figures"]["trainer_interleaved_over_1f1b_compute"].values()
    return (f"a chunk call's fixed cost: forward {f['chunk_call_fit']['forward']['intercept_ms']:+.2f} ms, backward "
            f"{f['chunk_call_fit']['backward']['intercept_ms']:+.2f} ms; trainer interleaved / 1F1B compute "
            f"{min(r):.3f}-{max(r):.3f}", None)


@row("schedules: per-action gap", "diagnostic")
def schedules_gap(d):
    r = [x for per in d["run_over_predicted"].values() for ranks in per.values() for x in ranks]
    return (f"pipeline F+B(+W) CPU time / the profile's price per rank {min(r):.3f}-{max(r):.3f} (median "
            f"{statistics.median(r):.3f})", None)


def table() -> list[str]:
    lines = ["| benchmark | command | current figure | target | date |", "|---|---|---|---|---|"]
    for name, (label, target, files, figure_of) in ROWS.items():
        found = [(json.loads(p.read_text()), p) for p in (BENCH / "results" / f"{f}.json" for f in files) if p.exists()]
        if not found:
            lines.append(f"| {label} | `python bench/{name}.py` | no results file yet | {target} | - |")
            continue
        d, path = max(found, key=lambda dp: dp[0].get("date", ""))
        figure, met = figure_of(d)
        verdict = {None: "", True: " (met)", False: " (not met)"}.get(met, f" ({met})")
        lines.append(f"| {label} | `{d.get('command', f'python bench/{name}.py').strip()}` | {figure} "
                     f"([{path.name}](results/{path.name})) | {target}{verdict} | {d.get('date', '?')[:10]} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table-only", action="store_true", help="print the table from the results files; run nothing")
    ap.add_argument("--only", default=None, help=f"comma-separated benches (default: all of {', '.join(ROWS)})")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(ROWS)
    if set(names) - set(ROWS):
        ap.error(f"--only: unknown {sorted(set(names) - set(ROWS))}; known: {', '.join(ROWS)}")
    failed = []
    for name in [] if args.table_only else names:
        start = time.time()
        print(f"== python bench/{name}.py", flush=True)
        if subprocess.run([sys.executable, str(BENCH / f"{name}.py")], cwd=BENCH.parent).returncode:
            failed.append(name)
        print(f"== {name}: {'FAILED' if name in failed else 'done'} in {time.time() - start:.0f} s", flush=True)
    print("\n".join(table()))
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
