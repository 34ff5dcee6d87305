"""Where bench/schedules.py's measured compute exceeds the profile's prediction (#16): per action kind.

Runs bench/schedules.py's plans on the same 4 processes and records, per rank and per action kind
(F, B, W per chunk), the thread CPU time of every timed call (what the emulation stretches), then
the same stage's forward + backward back-to-back in isolation (one rank at a time, the others wait
in a barrier: warm caches, no concurrency). Printed against the profile's per-action prediction
(divided by the island's slowdown: host seconds). Written to results/schedules_gap.json (``--output``).

    python bench/schedules_gap.py [--iters 4] [--isolated-reps 8] [--schedules 1f1b,...] [--output NAME.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from harness import (
    CLUSTER,
    MICRO_BATCH,
    MODEL,
    PROFILE,
    SCHEDULES,
    WARMUP,
    on_actions,
    plans,
    schedule_trainers,
    stamp,
    synthetic_batches,
    write_result,
)

from megatron_het.cluster import cluster_from_dict
from megatron_het.perf.profile import load_profile
from megatron_het.platform.local_launch import run_local


def _rank(rank, world_size, order, iters, reps):
    import torch
    import torch.distributed as dist

    batch_fn = synthetic_batches(MODEL)  # the trainers' own batches
    out = {}
    for name, trainer in schedule_trainers(order, iters):
        st, timer = trainer.strategy, trainer.timer
        cur, calls, timeline = [None], [], []
        orig_compute, orig_stretch = timer.compute, timer.stretch

        def reached(i, a):
            cur[0] = a
            if it[0] == iters:  # the last iteration's timeline: when each action was reached
                timeline.append([f"{a.kind}{a.micro_batch}.{a.chunk}", time.perf_counter(), None, None])

        it = on_actions(st.executor, reached)  # it[0]: the iteration running

        def compute(fn):
            c0 = time.thread_time()
            if it[0] == iters:
                timeline[-1][2] = time.perf_counter()
            r = orig_compute(fn)
            if it[0] == iters:
                timeline[-1][3] = time.perf_counter()
            if it[0] > WARMUP:
                calls.append((f"{cur[0].kind}{cur[0].chunk}", time.thread_time() - c0))
            return r

        def stretch(fn):
            c0 = time.thread_time()
            r = orig_stretch(fn)
            if it[0] > WARMUP:
                calls.append(("opt", time.thread_time() - c0))
            return r

        timer.compute, timer.stretch = compute, stretch
        res = trainer.run(iters)
        per_kind: dict[str, list[float]] = {}
        for k, v in calls:
            per_kind.setdefault(k, []).append(v)
        wait = [log.elapsed_s - log.compute_s for log in res.iterations[WARMUP:]]
        # Isolated: this rank's chunks forward + backward back-to-back, one rank at a time.
        iso: dict[str, list[float]] = {}
        for turn in range(world_size):
            dist.barrier()
            if turn != rank:
                continue
            for c in range(st.num_chunks):
                first, last = st.is_first and c == 0, st.is_last and c == st.num_chunks - 1
                for r in range(reps + 2):
                    tokens = batch_fn(0, range(MICRO_BATCH)) if first or last else None
                    inp = None if first else torch.randn(MODEL.seq_length, MICRO_BATCH, MODEL.hidden_size,
                                                         requires_grad=True)
                    c0 = time.thread_time()
                    o = st._forward(c, tokens, inp)
                    c1 = time.thread_time()
                    o.backward(None if last else torch.ones_like(o))
                    c2 = time.thread_time()
                    if r >= 2:
                        iso.setdefault(f"F{c}", []).append(c1 - c0)
                        iso.setdefault(f"B{c}", []).append(c2 - c1)
                for p in st.params.values():
                    p.grad = None
        dist.barrier()
        out[name] = {"run": {k: statistics.median(v) for k, v in per_kind.items()},
                     "run_n": {k: len(v) for k, v in per_kind.items()},
                     "isolated": {k: statistics.median(v) for k, v in iso.items()},
                     "wait_s": statistics.median(wait),
                     "elapsed_s": [log.elapsed_s for log in res.iterations],  # every iteration, warm-up included
                     "compute_s": [log.compute_s for log in res.iterations],
                     # last iteration: (action, reached, compute start, compute end) seconds from its first action
                     "timeline": [[n, *(None if t is None else t - timeline[0][1] for t in ts)]
                                  for n, *ts in timeline]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--isolated-reps", type=int, default=8)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--output", default="schedules_gap.json", help="results file under bench/results/")
    ap.add_argument("--profile", action="append", default=None,
                    help="profile(s) to price the actions from (default bench/schedules.py's); the first is printed")
    args = ap.parse_args()
    from megatron_het.perf.predict import action_duration, predict
    from megatron_het.schedule import Action

    paths = args.profile or [str(PROFILE)]
    cluster = cluster_from_dict(CLUSTER)

    def priced(plan, path):
        """The plan's stage predictions under the profile at ``path`` and its price of one action (rank, action)."""
        stages = predict(plan, MODEL, cluster, profile=load_profile(path)).replicas[0].stages
        return stages, action_duration(plan, plan.replicas[0], [s.forward_s for s in stages],
                                       [s.backward_s for s in stages], ends=[s.ends_s for s in stages],
                                       split=[s.backward_split for s in stages])

    table = plans()
    order = args.schedules.split(",")
    load = os.getloadavg()
    got = run_local(4, _rank, (order, args.iters, args.isolated_reps), timeout_s=3600)
    result = {"load_average_before": load, "load_average_after": os.getloadavg(), "profile": paths[0], "ranks": {},
              "run_over_predicted": {}}
    for name in order:
        plan = table[name]
        stages, dur = priced(plan, paths[0])
        print(f"== {name}: host seconds per action (run = thread CPU in the pipeline; iso = alone, warm)")
        for rank in range(4):
            k = cluster.slowdown(plan.replicas[0].stages[rank].island)
            row = got[rank][name]
            parts = []
            for kind, t in sorted(row["run"].items()):
                if kind == "opt":
                    parts.append(f"opt run {t * 1e3:.2f}ms pred {stages[rank].optimizer_s / k * 1e3:.2f}ms")
                    continue
                a = Action(kind=kind[0], micro_batch=0, chunk=int(kind[1]))
                p = dur(rank, a) / k
                iso = row["isolated"].get(kind)
                parts.append(f"{kind} run {t * 1e3:.2f} iso {iso * 1e3 if iso else float('nan'):.2f} "
                             f"pred {p * 1e3:.2f}ms (run/pred {t / p:.3f})")
            print(f"  rank {rank}: " + "; ".join(parts) + f"; wait {row['wait_s']:.3f}s")
            result["ranks"].setdefault(name, []).append({**row, "slowdown": k})
        # every profile: the ratio of the pipeline's summed F/B/W CPU time to the profile's price of the same actions
        for path in paths:
            d = priced(plan, path)[1]
            ratios = []
            for rank in range(4):
                k = cluster.slowdown(plan.replicas[0].stages[rank].island)
                run = got[rank][name]["run"]
                kinds = [kd for kd in run if kd != "opt"]
                ratios.append(sum(run[kd] for kd in kinds) / sum(
                    d(rank, Action(kind=kd[0], micro_batch=0, chunk=int(kd[1]))) / k for kd in kinds))
            result["run_over_predicted"].setdefault(path, {})[name] = ratios
            print(f"  {os.path.basename(path)}: run/predicted F+B(+W) per rank " + ", ".join(f"{r:.3f}" for r in ratios))
    print(f"load average before {load[0]:.1f} after {os.getloadavg()[0]:.1f}")
    write_result(args.output, {**result, **stamp()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
