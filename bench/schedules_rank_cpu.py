"""bench/schedules.py's own plans and cluster, each rank's compute CPU time per schedule (#16).

The same 4-process runs as bench/schedules.py (its plans, cluster, emulation with catch_up, rounds in
alternating order), recording per rank and iteration (after one warm-up) the thread CPU time of the
compute calls, their count, the involuntary context switches inside them and the iteration's elapsed time:
whether interleaved's actions cost more CPU than 1F1B's in the pipeline itself (bench/schedules_gap.py
fitted + 1.2 ms F / + 2.1 ms B per action there), beside the measured iteration time.

    python bench/schedules_rank_cpu.py [--iters 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

from bench_record import machine, perf_commit, write_result
from schedules import MODEL, SCHEDULES, plans, rank_setup

from megatron_het.platform.local_launch import run_local


def _rank(rank, world_size, order, iters):
    import gc
    import resource

    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    cluster, train, batch_fn = rank_setup(iters)

    out = {}
    for name in order:
        trainer = HeteroTrainer(model=MODEL, plan=plans()[name], train=train, batch_fn=batch_fn,
                                cluster=cluster, clock=time.thread_time)
        trainer.timer.catch_up = True  # as bench/schedules.py
        timed, calls = trainer.timer.compute, []

        def compute(fn, timed=timed, calls=calls):
            u0 = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
            c0 = time.thread_time()
            result = timed(fn)
            calls.append((time.thread_time() - c0, resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw - u0))
            return result

        trainer.timer.compute = compute
        res = trainer.run(iters)
        n = len(calls) // iters
        out[name] = [(sum(c for c, _ in calls[i * n:(i + 1) * n]), n, sum(s for _, s in calls[i * n:(i + 1) * n]),
                      res.iterations[i].elapsed_s) for i in range(1, iters)]
        trainer.close()  # as bench/schedules.py: no earlier trainer's gloo groups alive during the next plan
        del trainer, compute
        gc.collect()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=5, help="iterations per plan and round (the first is warm-up)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    load_before = os.getloadavg()
    rows = {n: [[] for _ in range(4)] for n in SCHEDULES}
    for r in range(args.rounds):
        order = list(SCHEDULES) if r % 2 == 0 else list(reversed(SCHEDULES))
        for rank, got in enumerate(run_local(4, _rank, (order, args.iters), timeout_s=3600)):
            for name, its in got.items():
                rows[name][rank].extend(its)
    load_after = os.getloadavg()
    figures = {}
    for name in SCHEDULES:
        per_rank = [{"compute_cpu_s": statistics.median(c for c, _, _, _ in its), "calls": its[0][1],
                     "involuntary_switches": statistics.median(s for _, _, s, _ in its)} for its in rows[name]]
        elapsed = [max(it[3] for it in step) for step in zip(*rows[name])]
        figures[name] = {"per_rank": per_rank, "elapsed_s_median": statistics.median(elapsed),
                         "elapsed_s_mean": statistics.mean(elapsed)}
        print(f"{name:12s} elapsed median {figures[name]['elapsed_s_median']:.3f} s (mean "
              f"{figures[name]['elapsed_s_mean']:.3f}); per rank compute CPU ms (calls, switches): " + ", ".join(
                  f"{r['compute_cpu_s'] * 1e3:.0f} ({r['calls']}, {r['involuntary_switches']:.0f})" for r in per_rank))
    ratio = [figures["interleaved"]["per_rank"][k]["compute_cpu_s"] / figures["1f1b"]["per_rank"][k]["compute_cpu_s"]
             for k in range(4)]
    print("interleaved / 1F1B compute CPU per rank: " + ", ".join(f"{x:.3f}" for x in ratio))
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}")
    write_result("schedules_rank_cpu.json", {
        "figures": {**figures, "interleaved_over_1f1b_compute_cpu": ratio},
        "targets": {"purpose": "diagnostic (no pass/fail target)"},
        "command": "python bench/schedules_rank_cpu.py " + " ".join(sys.argv[1:]),
        "setup": {"as": "bench/schedules.py plans and cluster", "iters": args.iters, "warmup": 1,
                  "rounds": args.rounds, "clock": "time.thread_time", "catch_up": True},
        "perf_commit": perf_commit(), "machine": machine(),
        "load_average_before": load_before, "load_average_after": load_after,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
