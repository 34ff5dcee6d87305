"""bench/schedules.py's own plans and cluster, each rank's compute CPU time per schedule (#16).

bench/schedules.py's plans, cluster and emulation (catch_up) on 4 processes, each plan in turn, rounds in
alternating order, recording per rank and iteration (after one warm-up) the thread CPU time of the compute
calls, their count and the involuntary context switches inside them, beside the iteration's elapsed time:
whether interleaved's actions cost more CPU than 1F1B's in the pipeline itself.

    python bench/schedules_rank_cpu.py [--iters 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from harness import (
    SCHEDULES,
    alternating,
    count_compute,
    per_iteration,
    schedule_trainers,
    slowest,
    stamp,
    write_result,
)

from megatron_het.platform.local_launch import run_local


def _rank(rank, world_size, order, iters):
    """Per plan in ``order``: per iteration after the first, (compute CPU s, calls, involuntary switches, elapsed s)."""
    import gc

    out = {}
    for name, trainer in schedule_trainers(order, iters, catch_up=True):  # catch_up: as bench/schedules.py
        calls = []
        count_compute(trainer.timer, lambda cpu, switches, calls=calls: calls.append((cpu, switches)))
        out[name] = per_iteration(calls, trainer.run(iters).iterations)
        trainer.close()  # as bench/schedules.py: no earlier trainer's gloo groups alive during the next plan
        del trainer
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
        for rank, got in enumerate(run_local(4, _rank, (alternating(SCHEDULES, r), args.iters), timeout_s=3600)):
            for name, its in got.items():
                rows[name][rank].extend(its)
    load_after = os.getloadavg()
    figures = {}
    for name in SCHEDULES:
        per_rank = [{"compute_cpu_s": statistics.median(c for c, _, _, _ in its), "calls": its[0][1],
                     "involuntary_switches": statistics.median(s for _, _, s, _ in its)} for its in rows[name]]
        elapsed = slowest([it[3] for it in its] for its in rows[name])
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
        "setup": {"as": "bench/schedules.py plans and cluster", "iters": args.iters, "warmup": 1,
                  "rounds": args.rounds, "clock": "time.thread_time", "catch_up": True},
        **stamp(load_before=load_before, load_after=load_after),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
