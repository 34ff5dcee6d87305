"""Where bench/schedules.py's iteration time goes beyond its actions' compute (#16): emulation overshoot,
boundary wake-up latency, and what a replay of the measured action durations through the simulator gives.

Runs bench/schedules.py's plans on the same 4 processes and records, per rank and action, absolute wall
times (CLOCK_MONOTONIC: one clock for all processes of this host): when the action was reached, when its
compute started, the compute's thread CPU time, the wall time before the emulation's sleep, and when the
stretched compute ended. Then, per schedule (iterations after warm-up):

- overshoot: stretched duration - thread CPU x island slowdown (preemption of a rank mid-action makes the
  emulation count wall time; a sleep's late wake-up adds the rest);
- wake-up latency: for an action waiting on another rank (reached before its producer ended), its compute
  start - the producer's compute end (the isend, gloo's threads and the receiver's scheduling);
- replay: the simulator (schedule.simulate) run with the *measured* duration of every action and no transfer
  time, against the measured pipeline time (first action start to last action end over the ranks).

It times the plain emulation (each action lasts max(wall, CPU x slowdown), no EmulationTimer.catch_up): the
overshoot it reports is what catch_up repays in bench/schedules.py.

    python bench/schedules_waits.py [--iters 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from harness import CLUSTER, MICRO_BATCHES, SCHEDULES, WARMUP, on_actions, plans, schedule_trainers, stamp, write_result

from megatron_het.cluster import cluster_from_dict
from megatron_het.platform.local_launch import run_local


def _rank(rank, world_size, order, iters):
    """Per plan: per iteration, [(action, reached, start, cpu, wall before sleep, end)] and (iteration start, end)."""
    out = {}
    for name, trainer in schedule_trainers(order, iters):
        timer = trainer.timer
        iters_rec: list[dict] = []
        cur: list = [None, None]  # action, reached
        orig_step = trainer.strategy.step

        def step(*a, **kw):
            iters_rec.append({"start": time.perf_counter(), "actions": [], "end": None})
            r = orig_step(*a, **kw)
            iters_rec[-1]["end"] = time.perf_counter()
            return r

        def reached(i, a):
            cur[0], cur[1] = f"{a.kind}{a.micro_batch}.{a.chunk}", time.perf_counter()

        def compute(fn):
            start, c0 = time.perf_counter(), time.thread_time()
            res = fn()
            cpu, wall = time.thread_time() - c0, time.perf_counter() - start
            extra = cpu * timer.slowdown - wall
            if extra > 0:
                time.sleep(extra)
                timer.emulated_s += extra
            end = time.perf_counter()
            timer._compute_s += end - start
            iters_rec[-1]["actions"].append((cur[0], cur[1], start, cpu, start + wall, end))
            return res

        on_actions(trainer.strategy.executor, reached)
        timer.compute, trainer.strategy.step = compute, step
        trainer.run(iters)
        out[name] = iters_rec[WARMUP:]
    return out


def analyse(name: str, per_rank: list[list[dict]], slowdowns: list[float]) -> dict:
    """Overshoot, wake-up latency and replay of one schedule's recorded iterations."""
    from megatron_het.schedule import build_schedule, simulate

    plan = plans()[name]
    p, v = 4, plan.virtual_pipeline_size
    sched = build_schedule(plan.schedule, p, MICRO_BATCHES, v)
    rows, conc = [], []
    for it in range(len(per_rank[0])):
        acts = [{a[0]: a[1:] for a in per_rank[k][it]["actions"]} for k in range(p)]
        t0 = min(a[1] for k in range(p) for a in acts[k].values())
        pipe = max(a[4] for k in range(p) for a in acts[k].values()) - t0
        elapsed = max(per_rank[k][it]["end"] - per_rank[k][it]["start"] for k in range(p))
        over, lat, cpu_x = [], [], []
        for k in range(p):
            for key, (reached, start, cpu, _, end) in acts[k].items():
                over.append(end - start - cpu * slowdowns[k])
                cpu_x.append(cpu * slowdowns[k])
                kind, rest = key[0], key[1:]
                mb, ch = (int(x) for x in rest.split("."))
                vs = ch * p + k
                if kind == "F" and vs > 0:
                    src, skey = (vs - 1) % p, f"F{mb}.{(vs - 1) // p}"
                elif kind == "B" and vs < p * v - 1:
                    src, skey = (vs + 1) % p, f"B{mb}.{(vs + 1) // p}"
                else:
                    continue
                prod_end = acts[src][skey][4]
                if reached < prod_end:  # it waited for the producer
                    lat.append(start - prod_end)

        # concurrency: the share of each action's compute (start .. wall before sleep) during which another
        # rank was computing too, against its CPU time relative to the median of its (rank, kind, chunk)
        spans = [[(a[1], a[3]) for a in acts[k].values()] for k in range(p)]
        for k in range(p):
            for key, (_, start, cpu, cend, _) in acts[k].items():
                busy = 0.0
                for j in range(p):
                    if j != k:
                        busy += sum(max(0.0, min(cend, e) - max(start, s)) for s, e in spans[j])
                conc.append((min(1.0, busy / max(cend - start, 1e-9)), (k, key[0], key.split(".")[1]), cpu))

        def dur(stage, action, _a=acts):
            r = _a[stage][f"{action.kind}{action.micro_batch}.{action.chunk}"]
            return r[4] - r[1]

        def dur_cpu(stage, action, _a=acts):
            return _a[stage][f"{action.kind}{action.micro_batch}.{action.chunk}"][2] * slowdowns[stage]

        med_lat = statistics.median(lat) if lat else 0.0
        rows.append({"pipeline_s": pipe, "elapsed_s": elapsed,
                     "replay_measured_durations_s": simulate(sched, dur).iteration_time,
                     "replay_measured_durations_plus_median_latency_s": simulate(
                         sched, dur, lambda a, b, x, _m=med_lat: _m).iteration_time,
                     "replay_cpu_x_slowdown_s": simulate(sched, dur_cpu).iteration_time,
                     "overshoot_sum_per_rank_s": [sum(a[4] - a[1] - a[2] * slowdowns[k]
                                                      for a in acts[k].values()) for k in range(p)],
                     "overshoot_median_s": statistics.median(over), "overshoot_max_s": max(over),
                     "waits": len(lat), "latency_median_s": med_lat, "latency_max_s": max(lat) if lat else 0.0,
                     "latency_p90_s": sorted(lat)[int(0.9 * len(lat))] if lat else 0.0})
    kinds: dict = {}
    for _, kind, cpu in conc:
        kinds.setdefault(kind, []).append(cpu)
    med = {k: statistics.median(v) for k, v in kinds.items()}
    bins = {"alone (<10% overlapped)": [], "10-50%": [], ">=50%": []}
    for share, kind, cpu in conc:
        b = "alone (<10% overlapped)" if share < 0.1 else "10-50%" if share < 0.5 else ">=50%"
        bins[b].append(cpu / med[kind])
    return {"iterations": rows, "cpu_over_median_by_overlap": {b: (statistics.mean(v) if v else None, len(v))
                                                               for b, v in bins.items()},
            "overlapped_share_mean": statistics.mean(c[0] for c in conc),
            "median": {k: statistics.median(r[k] for r in rows) for k in rows[0] if not isinstance(rows[0][k], list)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    args = ap.parse_args()
    cluster = cluster_from_dict(CLUSTER)
    order = args.schedules.split(",")
    load = os.getloadavg()
    got = run_local(4, _rank, (order, args.iters), timeout_s=3600)
    slowdowns = [cluster.slowdown(st.island) for st in plans()["1f1b"].replicas[0].stages]
    result = {}
    for name in order:
        res = analyse(name, [got[k][name] for k in range(4)], slowdowns)
        result[name] = res
        m = res["median"]
        print(f"== {name} (medians over {len(res['iterations'])} iterations)")
        print(f"  elapsed {m['elapsed_s']:.3f}s pipeline {m['pipeline_s']:.3f}s; replay of measured durations "
              f"{m['replay_measured_durations_s']:.3f}s (+median latency per hop "
              f"{m['replay_measured_durations_plus_median_latency_s']:.3f}s); replay of cpu x slowdown "
              f"{m['replay_cpu_x_slowdown_s']:.3f}s")
        print(f"  per-action overshoot median {m['overshoot_median_s'] * 1e3:.2f}ms max {m['overshoot_max_s'] * 1e3:.1f}ms"
              f"; waits {m['waits']:.0f} latency median {m['latency_median_s'] * 1e3:.2f}ms p90 "
              f"{m['latency_p90_s'] * 1e3:.2f}ms max {m['latency_max_s'] * 1e3:.1f}ms")
        print("  thread CPU / median of its kind, by the share of the compute another rank computed too: " + "; ".join(
            f"{b} {x:.3f} (n={n})" for b, (x, n) in res["cpu_over_median_by_overlap"].items() if n)
              + f"; mean overlapped share {res['overlapped_share_mean']:.2f}")
        print("  overshoot sum per rank per iteration (s): " + "; ".join(
            ", ".join(f"{x:.3f}" for x in r["overshoot_sum_per_rank_s"]) for r in res["iterations"]))
    print(f"load average before {load[0]:.1f} after {os.getloadavg()[0]:.1f}")
    write_result("schedules_waits.json", {"figures": result, **stamp(perf=False, load_before=load)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
