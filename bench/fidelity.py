"""Fidelity of the performance model on this machine: predicted vs measured iteration time.

Two ranks, one per core (more would oversubscribe the 2-core machine, and the model prices each rank
as a device of its own). Two CPU-emulated clusters:
- examples/clusters/cpu-pair.yaml: island `fast` (1 rank) and island `slow` (1 rank, emulated 2x
  slower: it waits the extra time without using the CPU);
- examples/clusters/cpu-2.yaml: one island of 2 ranks (tensor parallelism over gloo).
Plans cover uneven pipeline splits (1F1B and GPipe, either island first), data parallelism with
equal and speed-proportional micro-batch counts, TP2 and a homogeneous PP2.

Profile: tools/profile_host.py (layers, embedding, output layer + loss, AdamW step) with ``--concurrent 2
--threads 1``: two processes measure together, every repetition started at once, as the two
training ranks compute (measured here: two processes computing at once each run ~1.5x slower than
one alone, so the 2 vCPUs are not independent cores); then ``--tp-sizes 2`` (layers on two
processes, their collectives included); before and after the runs; the model uses the means. The host's links
(gloo all-reduce and send/recv between 2 processes, the alpha-beta fit of
megatron_het.profiling.links) are measured before and after as well and fitted together. Measured:
pretrain_gpt.py's entry (megatron_het.cli.pretrain.run with its command line: --hetero-cluster,
--hetero-plan, mock data), median over iterations after warm-up of the slowest rank's iteration
time, a fresh 2-process spawn per plan and round (a long-lived process was measured to slow down
as it builds trainer after trainer), rounds alternating the order of the plans.

Target: median absolute error <= 10%; the worst is reported.

    python bench/fidelity.py [--iters 6] [--rounds 2]      # ~3-5 min on a quiet 2-core machine
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace

from harness import ROOT, alternating, slowest, stamp, write_result

from megatron_het.cluster import ModelSpec, load_cluster
from megatron_het.perf.profile import MeasuredLink, Profile, load_profile, save_profile
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.plan.serialize import save_plan
from megatron_het.platform.local_launch import run_local
from megatron_het.profiling.links import fit_link, measure_link

MODEL = ModelSpec(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1000)
CLUSTERS = {"pair": "examples/clusters/cpu-pair.yaml", "cpu2": "examples/clusters/cpu-2.yaml"}
PROFILE = os.path.join(ROOT, "bench/results/fidelity_cpu_profile.json")
MICRO_BATCH, GLOBAL_BATCH, WARMUP = 2, 16, 2


def plans() -> dict[str, tuple[str, Plan]]:
    """name -> (cluster key, plan); 8 micro-batches of 2 samples per iteration."""
    def s(island, rank, layers, ranks=None):
        return StagePlan(island=island, device_type="CPU", ranks=ranks or (rank,), layers=layers)

    def plan(*replicas, schedule="1f1b"):
        return Plan(replicas=tuple(ReplicaPlan(stages=tuple(st), num_micro_batches=m) for st, m in replicas),
                    micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, schedule=schedule,
                    precision="fp32")  # what the profile measures; pretrain_gpt.py runs the plan's precision

    return {
        "pp2_equal_layers": ("pair", plan(([s("fast", 0, (0, 4)), s("slow", 1, (4, 8))], 8))),
        "pp2_balanced_layers": ("pair", plan(([s("fast", 0, (0, 5)), s("slow", 1, (5, 8))], 8))),
        "pp2_balanced_gpipe": ("pair", plan(([s("fast", 0, (0, 5)), s("slow", 1, (5, 8))], 8), schedule="gpipe")),
        "pp2_slow_first": ("pair", plan(([s("slow", 1, (0, 3)), s("fast", 0, (3, 8))], 8))),
        "dp2_equal": ("pair", plan(([s("fast", 0, (0, 8))], 4), ([s("slow", 1, (0, 8))], 4))),
        "dp2_by_speed": ("pair", plan(([s("fast", 0, (0, 8))], 5), ([s("slow", 1, (0, 8))], 3))),
        "tp2": ("cpu2", plan(([s("cpu", 0, (0, 8), ranks=(0, 1))], 8))),
        "pp2_homogeneous": ("cpu2", plan(([s("cpu", 0, (0, 4)), s("cpu", 1, (4, 8))], 8))),
    }


def pretrain_argv(cluster: str, plan_path: str, iters: int, model: ModelSpec = MODEL,
                  model_flags: tuple[str, ...] = ()) -> list[str]:
    """pretrain_gpt.py's command line for one plan (mock data; no eval, no checkpoints); ``model_flags``:
    further architecture flags (bench/moe.py's MoE flags)."""
    return ["--hetero-cluster", os.path.join(ROOT, cluster), "--hetero-plan", plan_path,
            "--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
            "--num-attention-heads", str(model.num_attention_heads), "--seq-length", str(model.seq_length),
            "--max-position-embeddings", str(model.seq_length), "--vocab-size", str(model.vocab_size),
            "--mock-data", "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH),
            "--train-iters", str(iters), "--lr", "1e-4", "--log-interval", str(iters), "--eval-iters", "0",
            # the model the prediction prices (ModelSpec's dropout 0; Megatron-LM's flags default to 0.1)
            "--hidden-dropout", str(model.hidden_dropout), "--attention-dropout", str(model.attention_dropout),
            *model_flags]


def pretrain_iteration_times(rank, world_size, argv):
    """One plan through pretrain_gpt.py's entry (megatron_het.cli.pretrain.run); its iteration times
    after the warm-up."""
    import contextlib
    import io

    from megatron_het.cli.pretrain import run
    from megatron_het.platform import detect_accelerator
    from megatron_het.runtime.arguments import parse_args

    with contextlib.redirect_stdout(io.StringIO()):  # the log lines are not the point
        result = run(parse_args(argv), detect_accelerator())
    return [log.elapsed_s for log in result.logs[WARMUP:]]


def measure_profiles(tag: str, model: ModelSpec = MODEL, layer_flags: tuple[str, ...] = (),
                     multi_flags: tuple[str, ...] = ("--tp-sizes", "2"),
                     name: str = "fidelity") -> tuple[list[str], str]:
    """tools/profile_host.py on two processes at once, one thread each (as the two ranks run), then the
    layers over two processes (``multi_flags``: TP=2, as the TP2 plan runs; bench/moe.py adds EP=2);
    their output files. ``layer_flags``: further flags of the measured layer (bench/moe.py's MoE layer)."""
    outs = [os.path.join(ROOT, "bench", "results", f".{name}_profile_{tag}_{i}.json") for i in range(2)]
    cmd = [sys.executable, os.path.join(ROOT, "tools/profile_host.py"), "--num-layers", "2", "--hidden-size",
           str(model.hidden_size), "--num-attention-heads", str(model.num_attention_heads), "--seq-length",
           str(model.seq_length), "--micro-batch-sizes", str(MICRO_BATCH), "--threads", "1", "--repeats", "7",
           "--device", "CPU", *layer_flags]
    parts = ["--vocab-size", str(model.vocab_size), "--optimizer"]
    subprocess.run(cmd + parts + ["--concurrent", "2", "--output", outs[0]], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(cmd + [*multi_flags, "--output", outs[1]], check=True, stdout=subprocess.DEVNULL)
    return outs[:1], outs[1]


def _mean(items):
    """Entries of several profiles (same entries, same order) with mean times."""
    return tuple(replace(e, forward_s=statistics.mean(p[i].forward_s for p in items),
                         backward_s=statistics.mean(p[i].backward_s for p in items))
                 for i, e in enumerate(items[0]))


def mean_profile(paths: list[str], tp_paths: list[str], link: MeasuredLink) -> Profile:
    """One profile: mean times of the tp=1 runs and of the multi-process runs (TP=2, EP=2), plus ``link``."""
    profiles = [load_profile(p) for p in paths]
    tp = [load_profile(p) for p in tp_paths]
    first = profiles[0]
    method = (first.method + f"; mean of {len(profiles)} runs (before and after the measurement); "
              f"multi-process entries: {tp[0].method}, mean of {len(tp)} runs")
    return replace(first, entries=_mean([p.entries for p in profiles]) + _mean([p.entries for p in tp]),
                   parts=_mean([p.parts for p in profiles]),
                   optimizer_s_per_parameter=statistics.mean(p.optimizer_s_per_parameter for p in profiles),
                   link=link, method=method, source=None)


def measure_and_predict(table: dict[str, tuple[str, Plan]], clusters: dict[str, str], *, iters: int, rounds: int,
                        profile_path: str, model: ModelSpec = MODEL, model_flags: tuple[str, ...] = (),
                        layer_flags: tuple[str, ...] = (), multi_flags: tuple[str, ...] = ("--tp-sizes", "2"),
                        name: str = "fidelity") -> dict:
    """Every plan of ``table`` run and predicted: the profile measured before and after the runs (saved
    to ``profile_path``), each plan's measured iteration times (fresh 2-process spawns, rounds in
    alternating order) and prediction. bench/moe.py runs the same with its MoE model."""
    from megatron_het.perf import predict

    (before, tp_before), link_before = measure_profiles("before", model, layer_flags, multi_flags, name), measure_link(2)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for plan_name, (key, plan) in table.items():
            path = os.path.join(tmp, f"{plan_name}.json")
            save_plan(plan, path)
            runs[plan_name] = pretrain_argv(clusters[key], path, iters, model, model_flags)
        # A fresh pair of processes per plan and round (a long-lived process slows down as it builds
        # trainer after trainer); rounds alternate the order of the plans.
        times: dict[str, list[list[float]]] = {n: [[], []] for n in table}
        for r in range(rounds):
            for plan_name in alternating(table, r):
                for rank, got in enumerate(run_local(2, pretrain_iteration_times, (runs[plan_name],),
                                                     timeout_s=1800)):
                    times[plan_name][rank].extend(got)
    load_during = os.getloadavg()[1]  # 5-minute mean: the two ranks alone make about 2
    (after, tp_after), link_after = measure_profiles("after", model, layer_flags, multi_flags, name), measure_link(2)
    link = fit_link(link_before.samples + link_after.samples, ranks=2, method=link_before.method + "; before and "
                    "after the measurement, fitted together")
    tp_paths = [tp_before, tp_after]
    profile = mean_profile(before + after, tp_paths, link)
    save_profile(profile, profile_path)
    layer_ms = {tag: statistics.mean(load_profile(p).entries[0].forward_s + load_profile(p).entries[0].backward_s
                                     for p in paths) * 1e3 for tag, paths in (("before", before), ("after", after))}
    for p in before + after + tp_paths:
        os.remove(p)

    loaded = {k: load_cluster(os.path.join(ROOT, p)) for k, p in clusters.items()}
    predictions = {n: predict(p, model, loaded[k], profile=profile) for n, (k, p) in table.items()}
    per_iteration = {n: slowest(times[n]) for n in table}
    measured = {n: statistics.median(v) for n, v in per_iteration.items()}
    predicted = {n: predictions[n].iteration_time_s for n in table}
    return {"predictions": predictions, "predicted": predicted, "measured": measured,
            "fastest": {n: min(v) for n, v in per_iteration.items()},
            "errors": {n: (predicted[n] - measured[n]) / measured[n] for n in table},
            "layer_ms": layer_ms, "link": link, "link_before": link_before, "link_after": link_after,
            "load_during": load_during}


def print_runs(table: dict[str, tuple[str, Plan]], res: dict) -> None:
    """The per-plan table, the profile's layer time and links, and a warning under other jobs' load."""
    print(f"{'plan':22s} {'cluster':8s} {'predicted s':>12s} {'measured s':>11s} {'error':>8s} {'fastest s':>10s}")
    for n, (k, _) in table.items():
        print(f"{n:22s} {k:8s} {res['predicted'][n]:12.4f} {res['measured'][n]:11.4f} {100 * res['errors'][n]:7.1f}% "
              f"{res['fastest'][n]:10.4f}")
    link, before, after = res["link"], res["link_before"], res["link_after"]
    print(f"\nlayer fwd+bwd per micro-batch: {res['layer_ms']['before']:.1f} ms before, {res['layer_ms']['after']:.1f} "
          f"ms after; links: {link.latency_us:.0f} us + {link.bandwidth_gbps:.2f} Gbit/s (before "
          f"{before.latency_us:.0f} us, {before.bandwidth_gbps:.2f}; after {after.latency_us:.0f} us, "
          f"{after.bandwidth_gbps:.2f})")
    if res["load_during"] > 2.5:
        print(f"WARNING: 5-minute load average {res['load_during']:.1f} while measuring (the two ranks make ~2): "
              f"other jobs shared the cores, measured times are inflated; rerun on a quiet machine")


def run_options(description: str, table: dict[str, tuple[str, Plan]]
                ) -> tuple[argparse.Namespace, dict[str, tuple[str, Plan]]]:
    """The command line of a run-and-predict bench (this one, bench/moe.py): --iters, --rounds, and
    --only's plans of ``table`` (unknown names refused)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--iters", type=int, default=6, help="iterations per plan and round (first 2 are warm-up)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default=None, help="comma-separated plan names (default: all)")
    args = ap.parse_args()
    if args.only:
        unknown = set(args.only.split(",")) - set(table)
        if unknown:
            ap.error(f"--only: unknown plans {sorted(unknown)}; known: {sorted(table)}")
        table = {n: v for n, v in table.items() if n in args.only.split(",")}
    return args, table


def main() -> int:
    args, table = run_options(__doc__.splitlines()[0], plans())
    res = measure_and_predict(table, CLUSTERS, iters=args.iters, rounds=args.rounds, profile_path=PROFILE)
    errors = res["errors"]
    abs_err = sorted(abs(e) for e in errors.values())
    median_err, worst = statistics.median(abs_err), max(abs_err)
    print_runs(table, res)
    print(f"median |error| {100 * median_err:.1f}% (target <= 10%), worst {100 * worst:.1f}%")
    link = res["link"]
    write_result("fidelity.json", {
        "figures": {"predicted_s": res["predicted"], "measured_s": res["measured"], "relative_error": errors,
                    "median_abs_error": median_err, "worst_abs_error": worst, "fastest_iteration_s": res["fastest"],
                    "load_average_5min_after_runs": res["load_during"],
                    "profile_layer_ms_before_after": res["layer_ms"],
                    "link": {"latency_us": link.latency_us, "bandwidth_gbps": link.bandwidth_gbps}},
        "targets": {"median_abs_error": "<= 0.10", "plans": ">= 5"},
        "setup": {"model": {k: v for k, v in MODEL.__dict__.items() if v is not None}, "clusters": CLUSTERS,
                  "profile": os.path.relpath(PROFILE, ROOT), "micro_batch_size": MICRO_BATCH,
                  "global_batch_size": GLOBAL_BATCH, "iters": args.iters, "warmup": WARMUP, "rounds": args.rounds,
                  "ranks": 2, "threads_per_rank": 1},
        **stamp(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
