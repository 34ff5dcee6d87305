"""Predicted vs published: the performance model against published GPU training runs (#17).

Rows: examples/published/*.yaml (Narayanan et al. 2021 Table 1 on A100; MosaicML llm-foundry's MPT
benchmarks on A100 40/80GB and H100, bf16 and fp8; torchtitan's Llama benchmarks on A100; NVIDIA
NeMo 24.12's fp8 pre-training and long-sequence tables on H100; dgxc-benchmarking's NeMo recipes on
H100), each with its citation. The compute model's figures
are fitted (megatron_het/perf/fit.py) in leave-one-source-out mode: every source's rows are priced
by a fit that never saw that source. Targets (issue #17): median |error| <= 10% and worst <= 25%
over those out-of-sample predictions; the sign of the error is not the same on every row of a
source; within a source, rows comparing configurations of one model (``group``) keep their
published order (pairs whose published figures differ by less than 5% are ties and not scored).
The in-sample error (fit on every row: the defaults shipped in megatron_het/perf/calibrated.py) is
shown beside it, and the shipped defaults are checked to be that fit.

    python bench/published.py [--markdown]     # ~2 min on the 2-core machine
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys

from harness import stamp, write_result

from megatron_het.perf import calibrated
from megatron_het.perf import fit as fitting
from megatron_het.perf.published import load_published

TIE = 0.05


def _throughput(row, iteration_s: float) -> float:
    """Tokens per second per GPU (comparable within a group)."""
    return row.plan.global_batch_size * row.model.seq_length / (iteration_s * row.gpus)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = ap.parse_args()
    rows = load_published()
    full = fitting.fit(rows)
    in_sample = {r.key: (p, e) for r, p, e in fitting.row_errors(rows, full.theta)}
    loso = fitting.leave_one_source_out(rows)
    out_of_sample = {r.key: (p, e) for _, errs in loso.values() for r, p, e in errs}

    errors = [out_of_sample[r.key][1] for r in rows]
    median, worst = statistics.median(abs(e) for e in errors), max(abs(e) for e in errors)
    signs = {}
    for source in sorted({r.source for r in rows}):
        es = [out_of_sample[r.key][1] for r in rows if r.source == source]
        signs[source] = {"rows": len(es), "over": sum(e > 0 for e in es), "under": sum(e < 0 for e in es),
                         "mixed": any(e > 0 for e in es) and any(e < 0 for e in es),
                         "median_abs": statistics.median(abs(e) for e in es), "worst_abs": max(abs(e) for e in es),
                         "theta": loso[source][0].theta}
    orderings = []
    groups: dict[str, list] = {}
    for r in rows:
        if r.group:
            groups.setdefault(f"{r.source}/{r.group}", []).append(r)
    for name, members in groups.items():
        for a, b in itertools.combinations(members, 2):
            pa, pb = _throughput(a, a.published_iteration_s), _throughput(b, b.published_iteration_s)
            if abs(pa / pb - 1) < TIE:
                continue
            qa, qb = _throughput(a, out_of_sample[a.key][0]), _throughput(b, out_of_sample[b.key][0])
            orderings.append({"group": name, "pair": [a.id, b.id], "published": [pa, pb], "predicted": [qa, qb],
                              "kept": (pa > pb) == (qa > qb)})
    shipped = {k: v for k, v in calibrated.FIT.get("theta", {}).items()}
    defaults_match = bool(shipped) and all(abs(shipped[k] / full.theta[k] - 1) < 2e-3 for k in shipped)
    checks = {
        "median_abs_error_le_10pct": median <= 0.10,
        "worst_abs_error_le_25pct": worst <= 0.25,
        "no_uniform_sign_per_source": all(s["mixed"] for s in signs.values()),
        "orderings_kept": all(o["kept"] for o in orderings),
        "shipped_defaults_are_the_full_fit": defaults_match,
    }

    def recompute(r) -> str:  # "full 16/32": block recomputation of the first 16 of a stage's 32 layers
        st = r.plan.replicas[0].stages[0]
        return f"{r.recompute} {st.recomputed_layers(r.plan.virtual_pipeline_size)}/{st.num_layers}" \
            if st.recompute_num_layers else r.recompute

    table = []
    for r in rows:
        p_out, e_out = out_of_sample[r.key]
        p_in, e_in = in_sample[r.key]
        table.append({"row": r.key, "where": r.where, "url": r.url, "device": r.device, "precision": r.precision,
                      "gpus": r.gpus, "tp": r.plan.replicas[0].stages[0].tp, "pp": len(r.plan.replicas[0].stages),
                      "dp": len(r.plan.replicas), "micro_batch": r.plan.micro_batch_size,
                      "global_batch": r.plan.global_batch_size, "recompute": recompute(r), "metric": r.metric,
                      "published": r.published, "published_iteration_s": r.published_iteration_s,
                      "predicted_iteration_s_loso": p_out, "error_loso": e_out,
                      "predicted_iteration_s_in_sample": p_in, "error_in_sample": e_in})
    if args.markdown:
        print("| row | device | prec | TP/PP/DP | mbs/gbs | recompute | published | published s/iter | "
              "predicted (left out) | error | in-sample error |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for t in table:
            unit = {"tokens_per_s_per_gpu": "tok/s/GPU", "seconds_per_iteration": "s/iter"}.get(t["metric"], "TFLOP/s/GPU")
            print(f"| {t['row']} | {t['device']} | {t['precision']} | {t['tp']}/{t['pp']}/{t['dp']} | "
                  f"{t['micro_batch']}/{t['global_batch']} | {t['recompute']} | {t['published']:g} {unit} | "
                  f"{t['published_iteration_s']:.3g} | {t['predicted_iteration_s_loso']:.3g} | "
                  f"{100 * t['error_loso']:+.1f}% | {100 * t['error_in_sample']:+.1f}% |")
    else:
        print(f"{'row':44s} {'device':10s} {'prec':5s} {'published s':>11s} {'LOSO s':>9s} {'LOSO err':>8s} "
              f"{'in-sample':>9s}")
        for t in table:
            print(f"{t['row']:44s} {t['device']:10s} {t['precision']:5s} {t['published_iteration_s']:11.4g} "
                  f"{t['predicted_iteration_s_loso']:9.4g} {100 * t['error_loso']:+7.1f}% "
                  f"{100 * t['error_in_sample']:+8.1f}%")
    print(f"\nleave-one-source-out over {len(rows)} rows, {len(signs)} sources: median |error| {100 * median:.1f}% "
          f"(target <= 10%), worst {100 * worst:.1f}% (target <= 25%)")
    for s, v in signs.items():
        print(f"  {s:14s} {v['rows']:2d} rows: median {100 * v['median_abs']:.1f}%, worst {100 * v['worst_abs']:.1f}%, "
              f"{v['over']} over / {v['under']} under")
    kept = sum(o["kept"] for o in orderings)
    print(f"orderings within a model: {kept}/{len(orderings)} pairs kept")
    for o in orderings:
        if not o["kept"]:
            print(f"  not kept: {o['group']} {o['pair']}")
    ins = [abs(e) for _, e in in_sample.values()]
    print(f"in-sample (shipped defaults): median |error| {100 * statistics.median(ins):.1f}%, worst {100 * max(ins):.1f}%")
    for k, ok in checks.items():
        print(f"  {k}: {'met' if ok else 'NOT met'}")
    write_result("published.json", {
        "benchmark": "published", **stamp(),
        "targets": {"median_abs_error": 0.10, "worst_abs_error": 0.25}, "checks": checks,
        "summary": {"rows": len(rows), "sources": len(signs), "median_abs_error": median, "worst_abs_error": worst},
        "fit_all_sources": full.theta, "per_source": signs, "orderings": orderings, "rows": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
