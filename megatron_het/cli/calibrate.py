"""Fit the compute model's per-device figures to published training runs; write them as profiles.

    python tools/calibrate.py [--data examples/published] [--sources narayanan2021,llmfoundry]
                              [--output DIR] [--write-defaults] [--leave-one-source-out] [--json]

Rows: examples/published/*.yaml (each a published run with its citation). The fit, its priors and
objective: megatron_het/perf/fit.py and docs/performance-model.md ("Calibration"). ``--output DIR``
writes DIR/<device type>.json, a profile with only a ``compute_model`` section, which
``tools/predict.py --profile`` and ``tools/plan.py --profile`` read; ``--write-defaults`` regenerates
megatron_het/perf/calibrated.py, the defaults the predictor uses without a profile (fit on every
row unless ``--sources`` narrows it). ``--leave-one-source-out`` also fits on all sources but one
and prices the one left out, for each source. Errors are one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from megatron_het.cli.output import check_output_file
from megatron_het.errors import UserError
from megatron_het.perf import fit as fitting
from megatron_het.perf.profile import save_profile
from megatron_het.perf.published import DEFAULT_DIR, load_published
from megatron_het.utils.atomic import write_text_atomic

CALIBRATED_PY = Path(__file__).resolve().parents[1] / "perf" / "calibrated.py"
ROOT = Path(__file__).resolve().parents[2]


def render_defaults(result: fitting.FitResult, *, data: str) -> str:
    """The text of megatron_het/perf/calibrated.py for a fit."""
    params = fitting.device_params(result.theta, source=f"fit of {len(result.rows)} published rows "
                                                            f"({', '.join(result.sources)}); tools/calibrate.py")
    calibrated = {name: {cls: p.to_dict() for cls, p in cm.items()} for name, cm in params.items()}
    fit_info = {"data": os.path.relpath(os.path.abspath(data), ROOT), "sources": list(result.sources), "rows": len(result.rows),
                "theta": {k: round(v, 6) for k, v in result.theta.items()},
                "priors": {k: v for k, (v, _) in fitting.PARAMETERS.items()},
                "objective": round(result.objective, 4)}
    text = CALIBRATED_PY.read_text(encoding="utf-8")
    head = text[:text.index("# How the figures below were obtained")]
    tail = ""
    body = ("# How the figures below were obtained (rows, sources, objective).\n"
            f"FIT: dict[str, object] = {json.dumps(fit_info, indent=4)}\n\n"
            "# device type name -> precision class -> fitted figures.\n"
            f"CALIBRATED: dict[str, dict[str, dict[str, object]]] = {json.dumps(calibrated, indent=4)}\n")
    return head + body.replace("true", "True").replace("false", "False") + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="calibrate.py", description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(DEFAULT_DIR), help="folder of published-run YAML files")
    ap.add_argument("--sources", help="comma-separated sources to fit on (default: all)")
    ap.add_argument("--output", help="folder to write one profile per fitted device type into")
    ap.add_argument("--write-defaults", action="store_true",
                    help="regenerate megatron_het/perf/calibrated.py from this fit")
    ap.add_argument("--leave-one-source-out", action="store_true",
                    help="also report each source's error when the fit does not see it")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        sources = [s for s in args.sources.split(",") if s] if args.sources else None
        if args.output is not None:
            out = Path(args.output)
            if out.exists() and not out.is_dir():
                raise UserError("exists and is not a folder", field="--output", value=args.output,
                                fix="pass a folder (it is created if missing)")
            check_output_file(out / "profile.json" if out.exists() else out, flag="--output")
        rows = load_published(args.data, sources=sources)
        result = fitting.fit(rows)
        errors = fitting.row_errors(rows, result.theta)
        loso = fitting.leave_one_source_out(load_published(args.data)) if args.leave_one_source_out else {}
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    written = []
    if args.output is not None:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        for profile in fitting.profiles_for(result.theta, source=f"tools/calibrate.py fit on {', '.join(result.sources)}"):
            path = out / f"{profile.device}.json"
            save_profile(profile, path)
            written.append(str(path))
    if args.write_defaults:
        write_text_atomic(CALIBRATED_PY, render_defaults(result, data=args.data))
        written.append(str(CALIBRATED_PY))
    report = {
        "fit": {"sources": list(result.sources), "rows": len(result.rows), "theta": result.theta},
        "rows": [{"row": r.key, "published_s": r.published_iteration_s, "predicted_s": p, "error": e}
                 for r, p, e in errors],
        "summary": fitting.summary([e for _, _, e in errors]),
        "leave_one_source_out": {s: {"theta": fr.theta, "rows": [{"row": r.key, "error": e} for r, _, e in errs],
                                     "summary": fitting.summary([e for _, _, e in errs])}
                                 for s, (fr, errs) in loso.items()},
        "written": written,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"fit on {len(result.rows)} rows from {', '.join(result.sources)}:")
    for k, v in result.theta.items():
        print(f"  {k:22s} {v:8.4g}   (prior {fitting.PARAMETERS[k][0]:g}: {fitting.PARAMETERS[k][1]})")
    print(f"{'row':44s} {'published s':>12s} {'predicted s':>12s} {'error':>7s}")
    for r, p, e in errors:
        print(f"{r.key:44s} {r.published_iteration_s:12.4g} {p:12.4g} {100 * e:+6.1f}%")
    s = report["summary"]
    print(f"in-sample: median |error| {100 * s['median_abs']:.1f}%, worst {100 * s['worst_abs']:.1f}%")
    for source, item in report["leave_one_source_out"].items():
        print(f"left out {source}: median |error| {100 * item['summary']['median_abs']:.1f}%, "
              f"worst {100 * item['summary']['worst_abs']:.1f}% over {item['summary']['rows']} rows")
    for w in written:
        print(f"wrote {w}")
    return 0
