"""Pipeline schedules side by side: 1F1B, interleaved (v=2) and ZB-H1, measured against the model's prediction (#16).

On the schedule benches' cluster (bench/harness.py: 4 stages, three on island ``fast`` and the last on
``slow``, emulated 2x slower, on the thread CPU clock with ``EmulationTimer.catch_up``); m = 8 micro-batches of 2.

Predicted: the performance model (megatron_het.perf.predict) with a profile of the emulated devices as the run
sees them, over the same schedule action lists the runtime executes. ``--profile run`` (default;
megatron_het.profiling.in_run): in every spawn, just before its trainers are built, all 4 ranks profile at once,
each on its own emulated device (waiting (slowdown - 1)x after every timed section, as in the run): layers,
parts, AdamW step, the B/W split's shares of the fused backward for ZB-H1, a chunk call's fixed cost, all in
thread CPU time. The median over all ranks of all spawns is one profile (results/schedules_profile.json) that
prices all three schedules; nothing in it comes from the timed iterations. ``--profile host``:
tools/profile_host.py in one process before the runs, the caches swept before each repetition.

Measured: per round one 4-process spawn builds the three plans' trainers side by side and runs them in turn,
one iteration each (the order rotating every iteration, rounds alternating it), so every schedule meets the
same moments of this shared host; then the trainers are closed. ``--sequential``: each plan runs all its
iterations in turn, its trainer closed before the next plan's (``--keep-groups``: not closed). The figure is
the median over the iterations after warm-up of the slowest rank's iteration time (the mean beside it).
Bubble: mean over ranks of the share of the iteration not spent in forward/backward (predicted the same way).
Per rank: the thread CPU time inside the compute calls (x the island's slowdown, against the stage's priced
compute), the timer's compute, and the threads and process groups alive when each trainer started. B/W split
overhead: one process, one 4-layer stage, F + fused B against F + B + W through the same executor (thread CPU
time, alternated pairs, median ratio). ``--serialize``: one rank computes at a time
(EmulationTimer.host_lock), so the emulated devices cannot inflate each other's CPU time through the caches.

Targets: |measured/predicted - 1| <= 15% per schedule; measured bubble ranking == predicted;
split overhead <= 5%.

    python bench/schedules.py [--iters 6] [--rounds 2] [--profile run|host] [--sequential [--keep-groups]]
                              [--serialize] [--output NAME.json]    # ~7 min here
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import statistics
import subprocess
import sys
import tempfile
import time

from harness import (
    CLUSTER,
    MICRO_BATCH,
    MICRO_BATCHES,
    MODEL,
    RESULTS,
    ROOT,
    SCHEDULES,
    SWEEP_MIB,
    WARMUP,
    alternating,
    count_compute,
    cpu_rank,
    plans,
    rank_setup,
    slowest,
    stamp,
    synthetic_batches,
    thread_clock_trainer,
    write_result,
)

from megatron_het.cluster import cluster_from_dict
from megatron_het.perf.profile import load_profile
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local


@contextlib.contextmanager
def host_lock(path: str):
    """One emulated rank computing at a time on this host (an exclusive flock on ``path``)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def profile_options() -> dict:
    """What the profile measures (both ways: tools/profile_host.py in one process, or in the run's ranks)."""
    import torch

    from megatron_het.perf.flops import padded_vocab_size

    return dict(num_layers=2, micro_batch_sizes=[MICRO_BATCH], device="CPU", warmup=3, repeats=7,
                dtype=torch.float32, vocab_size=padded_vocab_size(MODEL.vocab_size), optimizer=True,
                split_backward=True, call_overhead=True, clock="thread")


def _rank(rank, world_size, order, iters, lock_path=None, keep_groups=False, sequential=False, profile_in_run=False):
    """Every plan in ``order`` on this rank: {"plans": per plan, per iteration after warm-up, (elapsed, compute,
    compute CPU, lag) s, and the process's threads, process groups and resident memory when the plan's trainer
    started; "profile": this rank's profile (as a dict) when ``profile_in_run``, else None}.

    ``profile_in_run``: first, every rank profiles the layers at once on its emulated device
    (megatron_het.profiling.in_run.profile_in_rank), in this spawn, just before its trainers are built.

    compute: the timer's (CPU x slowdown, host lag included until repaid); compute CPU: the thread CPU time
    inside the timed calls alone (what the emulation multiplies); lag: the timer's unpaid lag at the end.
    Default (paired in time): the plans' trainers are built side by side and take turns iteration by
    iteration (the order rotating each iteration). ``sequential``: each plan runs all its iterations in turn;
    its trainer is closed (process groups destroyed) before the next plan's, unless ``keep_groups``."""
    import gc

    from megatron_het.perf.profile import profile_to_dict
    from megatron_het.profiling.in_run import profile_in_rank
    from megatron_het.runtime.group_ledger import live_groups

    cluster, train, batch_fn = rank_setup(iters)
    table = plans()
    profile = None
    if profile_in_run:
        island = table[order[0]].replicas[0].stages[rank].island
        profile = profile_to_dict(profile_in_rank(MODEL, slowdown=cluster.slowdown(island), **profile_options()))

    def alive() -> dict:
        gc.collect()
        proc = os.path.isdir("/proc/self/task")  # Linux: threads and resident memory; elsewhere -1
        return {"threads": len(os.listdir("/proc/self/task")) if proc else -1, "groups": len(live_groups()),
                "rss_mib": int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
                if proc else -1}

    def build(name):
        """The plan's trainer, its compute CPU counter and its rows (filled by its on_iteration)."""
        trainer = thread_clock_trainer(MODEL, table[name], train, batch_fn, cluster, catch_up=True)
        if lock_path:
            trainer.timer.host_lock = lambda: host_lock(lock_path)
        calls, rows = [], []
        count_compute(trainer.timer, lambda cpu, switches: calls.append(cpu))

        def on_iteration(log):
            rows.append((log.elapsed_s, log.compute_s, sum(calls), trainer.timer.lag_s))
            calls.clear()

        return trainer, on_iteration, rows

    out = {}
    if sequential:
        for name in order:
            start = alive()
            trainer, on_iteration, rows = build(name)
            trainer.run(iters, on_iteration=on_iteration)
            out[name] = {"iterations": rows[WARMUP:], "alive_at_start": start}
            if not keep_groups:
                trainer.close()
            del trainer, on_iteration
        return {"plans": out, "profile": profile}
    built = {}
    for name in order:
        start = alive()
        built[name] = (*build(name), start)
    for i in range(iters):
        k = i % len(order)
        for name in order[k:] + order[:k]:
            trainer, on_iteration, _, _ = built[name]
            trainer.run(1, on_iteration=on_iteration)
    for name in order:
        trainer, _, rows, start = built[name]
        out[name] = {"iterations": rows[WARMUP:], "alive_at_start": start}
        trainer.close()
    return {"plans": out, "profile": profile}


def _split_overhead(rank, world_size, reps):
    """One 4-layer stage (a fast stage of the plans), one process: thread CPU time of an iteration's F + fused B
    against F + B + W through the same executor, alternated ``reps`` times."""
    from dataclasses import replace

    import torch

    from megatron_het.runtime.executor import ActionExecutor
    from megatron_het.runtime.hetero_trainer import PipelineStrategy
    from megatron_het.runtime.megatron_trainer import split_tokens
    from megatron_het.schedule import Action
    from megatron_het.train.config import TrainConfig
    from megatron_het.train.timer import EmulationTimer

    cpu_rank()
    model = replace(MODEL, num_layers=4)
    m = 4
    stage = StagePlan(island="fast", device_type="CPU", ranks=(0,), layers=(0, 4))
    plan = Plan(replicas=(ReplicaPlan(stages=(stage,), num_micro_batches=m),), micro_batch_size=MICRO_BATCH,
                global_batch_size=MICRO_BATCH * m, precision="fp32")
    train = TrainConfig(micro_batch_size=MICRO_BATCH, global_batch_size=MICRO_BATCH * m, train_iters=1)
    batch_fn = synthetic_batches(model)
    st = PipelineStrategy(model=model, plan=plan, train=train, batch_fn=batch_fn)
    gpt = st.gpts[0]

    def forward(chunk, tokens, inp):
        inputs, labels, position_ids, _ = split_tokens(tokens, st.device)
        return gpt(inputs, position_ids, None, labels=labels).float().mean() / m

    def executor(kinds):
        acts = [Action(kind=k, micro_batch=g) for g in range(m) for k in kinds]
        return ActionExecutor(actions=acts, links=st.executor.links, is_first=True, is_last=True,
                              act_shape=(model.seq_length, MICRO_BATCH, model.hidden_size), dtype=torch.float32,
                              micro_batch_size=MICRO_BATCH, loss_scale=1.0, split_backward="W" in kinds,
                              store=st.wgrad_store, steps=range(len(acts)))  # one stage: no transfers

    fused, split = executor("FB"), executor("FBW")
    params = list(st.params.values())
    times = {"fused": [], "split": []}
    for i in range(reps + 1):
        for name, ex in (("fused", fused), ("split", split)) if i % 2 else (("split", split), ("fused", fused)):
            t0 = time.thread_time()
            ex.run(iteration=i, batch_fn=batch_fn, forward=forward, params=params, timer=EmulationTimer())
            if i:  # the first pair warms up
                times[name].append(time.thread_time() - t0)
            for p in params:
                p.grad = None
    return times


def measure_profile(path: str) -> None:
    """tools/profile_host.py: layers, embedding, output + loss and the AdamW step, one thread, timed like the
    run: thread CPU time (the emulation's clock) with the caches swept before each repetition (between two of
    a rank's actions the other ranks run on its core)."""
    opts = profile_options()  # the in-run path's settings, so the two ways measure the same things
    cmd = [sys.executable, os.path.join(ROOT, "tools/profile_host.py"), "--clock", opts["clock"], "--sweep-mib",
           str(SWEEP_MIB), "--num-layers", str(opts["num_layers"]), "--hidden-size",
           str(MODEL.hidden_size), "--num-attention-heads", str(MODEL.num_attention_heads), "--seq-length",
           str(MODEL.seq_length), "--micro-batch-sizes", ",".join(map(str, opts["micro_batch_sizes"])), "--threads", "1",
           "--warmup", str(opts["warmup"]), "--repeats", str(opts["repeats"]), "--device", opts["device"],
           "--vocab-size", str(MODEL.vocab_size), "--optimizer", "--split-backward", "--call-overhead",
           "--output", path]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def ranking(values: dict[str, float]) -> list[str]:
    return sorted(values, key=values.get)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=6, help=f"iterations per plan and round (first {WARMUP} warm-up)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--serialize", action="store_true",
                    help="one rank computes at a time (EmulationTimer.host_lock): no cache/memory contention between "
                         "the emulated devices, which the model does not price")
    ap.add_argument("--split-reps", type=int, default=20, help="fused/split iteration pairs of the overhead measurement")
    ap.add_argument("--keep-groups", action="store_true",
                    help="with --sequential: do not close a plan's trainer before the next one's (earlier trainers' "
                         "gloo groups and their threads stay alive in the rank's process)")
    ap.add_argument("--sequential", action="store_true",
                    help="each plan runs all its iterations in turn instead of the plans taking turns iteration by "
                         "iteration")
    ap.add_argument("--profile", choices=("run", "host"), default="run",
                    help="run: every rank of each spawn profiles the layers at once on its emulated device just before "
                         "its timed iterations (profiling.in_run), the median over all ranks and spawns prices every "
                         "schedule; host: tools/profile_host.py in one process before the runs")
    ap.add_argument("--output", default="schedules.json", help="results file under bench/results/")
    args = ap.parse_args()
    from megatron_het.perf import predict
    from megatron_het.perf.profile import profile_from_dict, save_profile
    from megatron_het.profiling.in_run import median_profile

    load_before = os.getloadavg()
    # kept beside the results (the predictions can be recomputed from it): schedules_profile.json, or
    # NAME_profile.json beside an --output NAME.json
    profile_path = str(RESULTS / (os.path.splitext(args.output)[0] + "_profile.json"))
    if args.profile == "host":
        measure_profile(profile_path)
    table = plans()
    cluster = cluster_from_dict(CLUSTER)
    for plan in table.values():
        plan.validate(MODEL, cluster)

    # per schedule and rank: (elapsed, compute, compute CPU, lag) per iteration after warm-up
    per_rank: dict[str, list[list[tuple[float, float, float, float]]]] = {n: [[] for _ in range(4)] for n in table}
    alive: dict[str, list[list[dict]]] = {n: [[] for _ in range(4)] for n in table}  # per round: threads, groups
    rank_profiles = []  # --profile run: per round and rank, the profile measured in that spawn
    with tempfile.TemporaryDirectory() as tmp:
        lock = os.path.join(tmp, "compute.lock") if args.serialize else None
        for r in range(args.rounds):
            for rank, got in enumerate(run_local(4, _rank, (alternating(SCHEDULES, r), args.iters, lock, args.keep_groups, args.sequential,
                                                            args.profile == "run"), timeout_s=3600)):
                for name, res in got["plans"].items():
                    per_rank[name][rank].extend(res["iterations"])
                    alive[name][rank].append(res["alive_at_start"])
                if got["profile"] is not None:
                    rank_profiles.append(profile_from_dict(got["profile"]))
    load_after = os.getloadavg()
    if args.profile == "run":
        islands = ", ".join(f"{CLUSTER['emulation'][s.island]['slowdown']:g}" for s in table["1f1b"].replicas[0].stages)
        save_profile(median_profile(rank_profiles, what=f"rank profiles of {args.rounds} spawns of bench/schedules.py "
                                    f"(4 ranks each, emulated slowdowns {islands}), measured just before each "
                                    "spawn's timed iterations"), profile_path)
    profile = load_profile(profile_path)
    predictions = {n: predict(p, MODEL, cluster, profile=profile) for n, p in table.items()}
    # each spawn's own profile, each rank's own profile: how much they differ (not used in the prediction)
    spread = {"per_round_layer_forward_backward_ms": [
        [round(1e3 * (q.entries[0].forward_s + q.entries[0].backward_s), 3) for q in rank_profiles[4 * r:4 * r + 4]]
        for r in range(len(rank_profiles) // 4)]}
    pairs = run_local(1, _split_overhead, (args.split_reps,), timeout_s=1800)[0]
    split_ratios = [b / a for a, b in zip(pairs["fused"], pairs["split"])]
    split_overhead = statistics.median(split_ratios) - 1

    slowdown = [CLUSTER["emulation"][isl]["slowdown"] for isl in ("fast", "fast", "fast", "slow")]
    measured, measured_mean, bubble, compute, predicted, pred_bubble = {}, {}, {}, {}, {}, {}
    compute_cpu, cpu_over_price = {}, {}
    for name in table:
        rows = list(zip(*per_rank[name]))  # per iteration: one (elapsed, compute, compute CPU, lag) per rank
        elapsed = slowest([r[0] for r in per_rank[name][k]] for k in range(4))
        measured[name], measured_mean[name] = statistics.median(elapsed), statistics.mean(elapsed)
        bubble[name] = statistics.median(statistics.mean(1 - r[1] / t for r in it) for it, t in zip(rows, elapsed))
        compute[name] = [statistics.median(r[1] for r in per_rank[name][k]) for k in range(4)]
        compute_cpu[name] = [statistics.median(r[2] for r in per_rank[name][k]) for k in range(4)]
        pred = predictions[name]
        cpu_over_price[name] = [compute_cpu[name][k] * slowdown[k] / pred.replicas[0].stages[k].compute_s
                                for k in range(4)]
        predicted[name] = pred.iteration_time_s
        stages = pred.replicas[0].stages
        pred_bubble[name] = statistics.mean(1 - s.compute_s / pred.iteration_time_s for s in stages)
    ratio = {n: measured[n] / predicted[n] for n in table}
    overhead = [compute["zb-h1"][k] / compute["1f1b"][k] - 1 for k in range(4)]
    ok_ratio = all(abs(r - 1) <= 0.15 for r in ratio.values())
    ok_rank = ranking(bubble) == ranking(pred_bubble)

    print(f"{'schedule':12s} {'predicted s':>11s} {'measured s':>10s} {'meas/pred':>9s} {'mean/pred':>9s} "
          f"{'bubble pred':>11s} {'bubble meas':>11s}")
    for n in table:
        print(f"{n:12s} {predicted[n]:11.3f} {measured[n]:10.3f} {ratio[n]:9.3f} {measured_mean[n] / predicted[n]:9.3f} "
              f"{pred_bubble[n]:11.1%} {bubble[n]:11.1%}")
    print(f"profile: ZB-H1's B and W priced at {profile.backward_split[0]:.3f} and {profile.backward_split[1]:.3f} "
          "of the fused backward (measured split)" if profile.backward_split else "profile: no measured B/W split")
    print(f"bubble ranking (least first): predicted {ranking(pred_bubble)}, measured {ranking(bubble)} "
          f"({'equal' if ok_rank else 'DIFFERENT'})")
    print(f"B/W split overhead, one 4-layer stage, F+B+W vs F+fused B thread CPU time (median of {len(split_ratios)} "
          f"alternated pairs): {100 * split_overhead:+.1f}% (target <= 5%); in the pipeline runs, ZB-H1 vs 1F1B "
          "forward+backward per rank: " + ", ".join(f"{100 * o:+.1f}%" for o in overhead))
    for n in table:
        print(f"{n:12s} per rank: compute CPU ms " + ", ".join(f"{1e3 * c:.0f}" for c in compute_cpu[n])
              + "; CPU x slowdown / price " + ", ".join(f"{x:.3f}" for x in cpu_over_price[n])
              + "; timer compute / price " + ", ".join(
                  f"{compute[n][k] / predictions[n].replicas[0].stages[k].compute_s:.3f}" for k in range(4))
              + "; threads/groups alive at start " + ", ".join(
                  f"{a['threads']}/{a['groups']}" for a in alive[n][0]))
    print(f"profile: {args.profile} ({profile_path}); per layer forward {1e3 * profile.entries[0].forward_s:.3f} ms, "
          f"backward {1e3 * profile.entries[0].backward_s:.3f} ms"
          + (f"; each rank's layer F+B ms per spawn: {spread['per_round_layer_forward_backward_ms']}"
             if rank_profiles else ""))
    print(f"measured/predicted within 15%: {'yes' if ok_ratio else 'NO'}; load average before {load_before[0]:.1f}, "
          f"after {load_after[0]:.1f}")
    write_result(args.output, {
        "figures": {"predicted_iteration_s": predicted, "measured_iteration_s": measured,
                    "measured_over_predicted": ratio, "measured_iteration_mean_s": measured_mean,
                    "measured_mean_over_predicted": {n: measured_mean[n] / predicted[n] for n in table},
                    "profile_backward_split": profile.backward_split, "predicted_bubble": pred_bubble, "measured_bubble": bubble,
                    "predicted_bubble_ranking": ranking(pred_bubble), "measured_bubble_ranking": ranking(bubble),
                    "split_overhead": split_overhead, "split_overhead_pair_ratios": split_ratios,
                    "split_fused_s": pairs["fused"], "split_split_s": pairs["split"],
                    "pipeline_zbh1_over_1f1b_compute_per_rank": overhead,
                    "compute_s_per_rank": compute, "compute_cpu_s_per_rank": compute_cpu,
                    "compute_cpu_x_slowdown_over_price_per_rank": cpu_over_price,
                    "alive_at_trainer_start_per_rank_and_round": alive,
                    "iterations_per_rank": per_rank,
                    "predicted_compute_s_per_stage": {n: [st.compute_s for st in predictions[n].replicas[0].stages]
                                                      for n in table},
                    "profile_layer_forward_s": profile.entries[0].forward_s,
                    "profile_layer_backward_s": profile.entries[0].backward_s,
                    "rank_profiles_layer_forward_plus_backward_ms_per_round": spread[
                        "per_round_layer_forward_backward_ms"]},
        "targets": {"measured_over_predicted": "within 1 +- 0.15 for each schedule",
                    "bubble_ranking": "measured == predicted", "split_overhead": "<= 0.05"},
        "met": {"measured_over_predicted": ok_ratio, "bubble_ranking": ok_rank,
                "split_overhead": split_overhead <= 0.05},
        "setup": {"model": {k: v for k, v in MODEL.__dict__.items() if v is not None}, "cluster": CLUSTER,
                  "micro_batch_size": MICRO_BATCH, "micro_batches": MICRO_BATCHES, "iters": args.iters,
                  "warmup": WARMUP, "rounds": args.rounds, "serialized_compute": args.serialize,
                  "plans_paired_in_time": not args.sequential,
                  "trainers_closed_between_plans": args.sequential and not args.keep_groups, "plans": {n: p.to_dict() for n, p in table.items()},
                  "emulation_clock": "time.thread_time", "threads_per_rank": 1, "profile_clock": "thread",
                  "profile_measured": args.profile, "profile_sweep_mib": SWEEP_MIB if args.profile == "host" else 0,
                  "profile": os.path.relpath(profile_path, ROOT)},
        **stamp(load_before=load_before, load_after=load_after),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
