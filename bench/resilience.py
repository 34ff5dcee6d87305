"""Throughput after rank failures without spare GPUs: (a) restart, (b) drop replica, (c)/(d) re-route.

The same failure trace (1 failure: rank 3 in iteration 1; 2 failures: then rank 0 in iteration 2)
under four policies, measured side by side on the emulated cluster and predicted by the simulator, then
simulated at cluster scale (1,024 GPUs, a failure every 4 hours): (a) restart from the last checkpoint on
the survivors with a re-plan (a real restart measured: spawn, import, build, load; amortised over
``--horizon`` s, lost iterations not counted); (b) drop the replica(s) that lost a rank; (c) re-route
in-process with a fused backward and a synchronous step; (d) re-route with split backward (W deferred into
bubbles) and the staggered step. Every run uses --clip-grad 0, so all rows train the same model alike.

Cluster ``examples/clusters/cpu-resilience.yaml``: 6 ranks, every island emulated 8x slower than the CPU
on the thread CPU clock (other jobs' load is absorbed by the sleep); 3 replicas x 2 stages, 4
micro-batches of 4 x 128 tokens each. Figure: median step time (max over ranks) of the iterations after
the last failure, as a fraction of the failure-free run's. Predicted: the routed-schedule simulator with
unit durations (F=1, fused B=2, split B=W=1), one unit and the per-step work outside the schedule
calibrated on the failure-free run only. Method and figures: docs/resilience.md#benchmark.

    python bench/resilience.py [--iters 6] [--horizon 600]   (about 12 minutes)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

from harness import ROOT, cpu_rank, stamp, synthetic_batches, thread_clock_trainer, write_result

from megatron_het.cluster import ModelSpec, load_cluster
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local
from megatron_het.resilience.launch import run_resilient_local
from megatron_het.resilience.recovery import FaultSpec
from megatron_het.resilience.routed_schedule import routed_schedule
from megatron_het.resilience.routing import reroute
from megatron_het.resilience.staggered import steady_period
from megatron_het.resilience.worker import homogeneous_replan, resilient_worker
from megatron_het.train.config import TrainConfig

CLUSTER = ROOT / "examples" / "clusters" / "cpu-resilience.yaml"
MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=128, vocab_size=200)
MBS = 4  # sequences per micro-batch
MICRO = 4  # micro-batches per replica in the failure-free plan
TIMEOUTS = {"heartbeat_timeout_s": 5.0, "pg_timeout_s": 20.0, "agreement_timeout_s": 40.0}


def plan_of(replicas: list[int], total_micro: int) -> Plan:
    """Replicas (original indices) of the 3x2 grid renumbered from rank 0, the global batch kept."""
    reps = []
    for i, _ in enumerate(replicas):
        stages = tuple(StagePlan(island="cpu", device_type="CPU", ranks=(2 * i + s,), layers=((0, 2), (2, 4))[s])
                       for s in range(2))
        reps.append(ReplicaPlan(stages=stages, num_micro_batches=total_micro // len(replicas)
                                + (i < total_micro % len(replicas))))
    return Plan(replicas=tuple(reps), micro_batch_size=MBS, global_batch_size=MBS * total_micro)


def steady(elapsed: list[dict[int, float]], first: int) -> float:
    """Median over iterations >= first of the max over ranks of each step's time."""
    its = sorted(set.intersection(*[set(e) for e in elapsed]))
    per_it = [max(e[i] for e in elapsed) for i in its if i >= first]
    return statistics.median(per_it)


def cpu_clock_resilient_worker(rank, world_size, address, *args):
    """resilient_worker whose timer stretches each forward/backward to slowdown x its thread CPU time."""
    return resilient_worker(rank, world_size, address, *args, clock=time.thread_time)


def plain_worker(rank, world_size, plan, train, iterations, slowdown, save_dir, load_dir):
    """Failure-free run of ``plan`` (drop-replica baseline), or the restart measurement when load_dir."""
    t_start = time.time()
    from megatron_het.checkpoint.dist_ckpt import iteration_dir, latest_iteration

    cpu_rank(threads=None)
    trainer = thread_clock_trainer(MODEL, plan, train, synthetic_batches(MODEL, train.seed), slowdown=slowdown)
    loaded_at = None
    if load_dir:
        trainer.load_checkpoint(iteration_dir(load_dir, latest_iteration(load_dir)))
        loaded_at = time.time()
    logs = trainer.run(iterations).iterations
    if save_dir:
        trainer.save_checkpoint(save_dir)
    return {"elapsed": {log.iteration: log.elapsed_s for log in logs}, "started_at": t_start, "loaded_at": loaded_at}


def simulated(plan: Plan, failed=(), *, split: bool, staggered: bool, step_units: float, barrier: bool = True,
              spread: int = 1, iterations: int = 3) -> float:
    """Steady iteration period in simulator units: compute (F=1, fused B=2, split B=W=1) plus the
    optimizer-side work outside the schedule as one step action of ``step_units`` per instance."""
    return steady_period(reroute(plan, failed, spread=spread), staggered=staggered, split_backward=split,
                         step_s=step_units, world_barrier=barrier, iterations=iterations)


def finished(outcomes) -> list:
    return [o.result["report"] for o in outcomes if o.status == "ok" and o.result["report"].status == "finished"]


# ---- cluster scale (simulator only) -----------------------------------------------------------
SCALE = {"replicas": 16, "stages": 8, "tp": 8, "layers": 32, "micro_batches": 8, "step_units": 2.0,
         "failure_every_h": 4.0, "hours": 24.0, "restart_min": 10.0, "checkpoint_interval_min": 30.0, "seed": 0}


def scale_plan(c=SCALE) -> Plan:
    r_, s_, t_, l_ = c["replicas"], c["stages"], c["tp"], c["layers"]
    return Plan(replicas=tuple(ReplicaPlan(stages=tuple(
        StagePlan(island="gpu", device_type="CPU", ranks=tuple(range((r * s_ + s) * t_, (r * s_ + s + 1) * t_)),
                  layers=(s * l_ // s_, (s + 1) * l_ // s_)) for s in range(s_)), num_micro_batches=c["micro_batches"])
        for r in range(r_)), micro_batch_size=1, global_batch_size=r_ * c["micro_batches"])


def scale_study(c=SCALE) -> dict:
    """Throughput / failure-free of (a)-(d) after k = 1.. failures of random GPUs, and averaged over the
    trace (a failure every ``failure_every_h``, no repair within ``hours``)."""
    import random

    plan = scale_plan(c)
    gpus = plan.world_size
    per_replica = len(plan.replicas[0].ranks)
    rng = random.Random(c["seed"])
    n_fail = int(c["hours"] // c["failure_every_h"])
    failed: list[int] = []
    step = c["step_units"]
    free = simulated(plan, split=False, staggered=False, step_units=step, iterations=2)
    free_zb = simulated(plan, split=True, staggered=True, step_units=step, barrier=False, iterations=2)
    rows = []
    for k in range(1, n_fail + 1):
        failed.append(rng.randrange(gpus))
        broken = {g // per_replica for g in failed}
        row = {"failures": k,
               "a_restart_replan": ((gpus - len(set(failed))) // per_replica) / len(plan.replicas),
               "b_drop_replica": (len(plan.replicas) - len(broken)) / len(plan.replicas),
               "c_reroute_fused_sync": free / simulated(plan, failed, split=False, staggered=False, step_units=step,
                                                        iterations=2),
               "d_reroute_split_staggered": free / simulated(plan, failed, split=True, staggered=True, step_units=step,
                                                             barrier=False, iterations=2)}
        # the same (d) against a failure-free run that also uses the zero-bubble (split) schedule
        row["d_vs_zero_bubble_failure_free"] = row["d_reroute_split_staggered"] * free_zb / free
        rows.append(row)
    # time average over the trace: k failures between failure k and k+1 (first interval failure-free);
    # a restart loses restart_min plus half a checkpoint interval of work per failure
    interval = c["failure_every_h"] * 60.0
    lost = c["restart_min"] + c["checkpoint_interval_min"] / 2
    average = {}
    for key in ("a_restart_replan", "b_drop_replica", "c_reroute_fused_sync", "d_reroute_split_staggered",
                "d_vs_zero_bubble_failure_free"):
        total = interval  # the first interval at full throughput
        for row in rows[:-1]:
            kept = interval - lost if key == "a_restart_replan" else interval
            total += row[key] * kept
        average[key] = total / (interval * len(rows))
    return {"setup": {**c, "gpus": gpus, "failure_free_units": free, "failure_free_zero_bubble_units": free_zb,
                      "failed_gpus": failed},
            "after_k_failures": rows, "time_average_over_trace": average}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=6, help="measured iterations per phase")
    ap.add_argument("--horizon", type=float, default=600.0, help="seconds over which a restart is amortised")
    ap.add_argument("--out", default="resilience.json", help="results file under bench/results/")
    args = ap.parse_args()
    n = args.iters
    slowdown = load_cluster(CLUSTER).slowdown("cpu")
    total = 3 * MICRO
    train = TrainConfig(micro_batch_size=MBS, global_batch_size=MBS * total, train_iters=3 * n + 3, lr=1e-3,
                        clip_grad=0.0)
    full = plan_of([0, 1, 2], total)
    t0 = time.time()
    load_before = os.getloadavg()
    fused = {**TIMEOUTS, "split_backward": False}  # (c)
    recycle = {**TIMEOUTS, "split_backward": True, "staggered_step": True}  # (d)
    split_only = {**TIMEOUTS, "split_backward": True}  # (d) without the staggered step
    f1 = (FaultSpec(rank=3, iteration=1, after_actions=1),)
    f2 = (FaultSpec(rank=3, iteration=1, after_actions=1), FaultSpec(rank=0, iteration=2, after_actions=2))

    def resilient(faults, config, iterations, reference=False):
        return run_resilient_local(6, cpu_clock_resilient_worker, (MODEL, full, train, iterations, faults, config,
                                                                   reference, None, slowdown))

    # failure-free reference + (c) 1 failure; steady = the iterations after the redo
    out1 = resilient(f1, fused, n + 2, reference=True)
    t_free = steady([o.result["reference_elapsed"] for o in out1 if o.status == "ok"], 2)
    busy = steady([o.result["reference_compute"] for o in out1 if o.status == "ok"], 2)
    ref_losses = next(o.result["reference"] for o in out1 if o.status == "ok")
    runs = {"c_1": (out1, 3)}
    runs["d_1"] = (resilient(f1, recycle, n + 2), 3)
    runs["split_1"] = (resilient(f1, split_only, n + 2), 3)
    runs["c_2"] = (resilient(f2, fused, n + 3), 4)
    runs["d_2"] = (resilient(f2, recycle, n + 3), 4)
    steps, events, loss_ok = {}, {}, {}
    for name, (out, first) in runs.items():
        reps = finished(out)
        steps[name] = steady([r.elapsed_s for r in reps], first)
        events[name] = [e.resumed_at - e.detected_at for e in reps[0].events]
        loss_ok[name] = max(abs(v - ref_losses[i]) / abs(ref_losses[i]) for r in reps for i, v in r.losses.items()
                            if i in ref_losses)

    with tempfile.TemporaryDirectory() as ckpt:
        # (b) drop the broken replicas: 2 intact replicas after 1 failure, 1 after 2 (global batch kept)
        drop1 = run_local(4, plain_worker, (plan_of([0, 2], total), train, n + 1, slowdown, ckpt, None))
        t_drop1 = steady([r["elapsed"] for r in drop1], 2)
        drop2 = run_local(2, plain_worker, (plan_of([2], total), train, n + 1, slowdown, None, None))
        t_drop2 = steady([r["elapsed"] for r in drop2], 2)
        # (a) real restart: spawn 4 fresh processes, build the re-planned trainer, load the checkpoint
        replan = homogeneous_replan(full, 4)
        spawn_at = time.time()
        restart = run_local(4, plain_worker, (replan, train, n + 1, slowdown, None, ckpt))
        restart_s = max(r["loaded_at"] for r in restart) - spawn_at
        t_replan = steady([r["elapsed"] for r in restart], 2)

    # calibration on the failure-free run only: one unit (F) and the per-step work outside the schedule
    p_free = routed_schedule(reroute(full, ()), split_backward=False).iteration_time
    unit_s = busy / (MICRO * 3)  # a stage's busy units per failure-free iteration: 4 x (F=1 + B=2)
    step_units = max(0.0, (t_free - p_free * unit_s) / unit_s)
    keep = max(0.0, 1.0 - restart_s / args.horizon)
    def units(plan, failed=(), split=False, staggered=False, barrier=True):
        return simulated(plan, failed, split=split, staggered=staggered, step_units=step_units, barrier=barrier)

    sim = {  # name: (measured step s, kept share, simulated units with the runtime's barrier, ReCycle without)
        "a_restart_replan_1_failure": (t_replan, keep, units(replan), None),
        "a_restart_replan_2_failures": (t_replan, keep, units(replan), None),
        "b_drop_replica_1_failure": (t_drop1, 1.0, units(plan_of([0, 2], total)), None),
        "b_drop_replica_2_failures": (t_drop2, 1.0, units(plan_of([2], total)), None),
        "c_reroute_fused_sync_1_failure": (steps["c_1"], 1.0, units(full, (3,)), None),
        "c_reroute_fused_sync_2_failures": (steps["c_2"], 1.0, units(full, (3, 0)), None),
        "reroute_split_sync_1_failure": (steps["split_1"], 1.0, units(full, (3,), split=True), None),
        "d_reroute_split_staggered_1_failure": (steps["d_1"], 1.0, units(full, (3,), True, True),
                                                units(full, (3,), True, True, barrier=False)),
        "d_reroute_split_staggered_2_failures": (steps["d_2"], 1.0, units(full, (3, 0), True, True),
                                                 units(full, (3, 0), True, True, barrier=False)),
    }
    free_units = units(full)  # = t_free / unit_s
    rows = {k: {"measured": t_free / t * kept, "predicted": free_units / u * kept,
                "predicted_recycle_no_barrier": (free_units / r * kept) if r else None,
                "measured_over_predicted": (t_free / t) / (free_units / u)}
            for k, (t, kept, u, r) in sim.items()}
    t_scale = time.time()
    scale = scale_study()
    scale_wall = time.time() - t_scale
    figures = {
        "fractions_of_failure_free_throughput": rows,
        "losses_max_relative_difference_vs_failure_free": loss_ok,
        "calibration": {"unit_s": unit_s, "step_units": step_units, "failure_free_busy_s_per_stage": busy,
                        "failure_free_step_s": t_free},
        "steady_step_s": {**steps, "failure_free": t_free, "drop_1": t_drop1, "drop_2": t_drop2,
                          "restart_replan": t_replan},
        "restart_seconds_measured": restart_s,
        "horizon_s": args.horizon,
        "recovery_seconds_detect_to_resume": events,
        "cluster_scale_simulated": scale,
        "cluster_scale_wall_s": scale_wall,
        "setup": {"cluster": os.path.relpath(CLUSTER, ROOT), "slowdown": slowdown,
                  "plan": f"3 replicas x 2 stages, TP=1, {MICRO} micro-batches each (global {total} x mbs {MBS})",
                  "iterations": n, "model": dataclasses.asdict(MODEL), "clip_grad": 0.0,
                  "emulation": f"each forward/backward stretched to {slowdown:g}x its thread CPU time by "
                               "sleeping (EmulationTimer(clock=time.thread_time))"},
        "bench_wall_s": time.time() - t0,
    }
    write_result(args.out, {
        "figures": figures,
        "targets": {"d_1_failure": "(d) beats (a) and (b) after one failure on the emulated cluster, else explained",
                    "losses": "every re-routed run's losses equal the failure-free run (relative 1e-5)",
                    "measured_vs_predicted": "side by side; differences explained in docs/resilience.md"},
        **stamp(perf=False, load_before=load_before),
    })
    print(f"failure-free iteration {t_free:.2f} s; restart {restart_s:.1f} s; slowdown {slowdown:g}x; "
          f"load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'throughput / failure-free':<42}{'measured':>10}{'predicted':>11}{'ReCycle':>9}{'meas/pred':>11}")
    for k, r in rows.items():
        rc = f"{r['predicted_recycle_no_barrier']:.2f}" if r["predicted_recycle_no_barrier"] else "-"
        print(f"{k:<42}{r['measured']:>10.2f}{r['predicted']:>11.2f}{rc:>9}{r['measured_over_predicted']:>11.2f}")
    print("max relative loss difference vs failure-free:", json.dumps({k: f"{v:.1e}" for k, v in loss_ok.items()}))
    print(f"cluster scale ({scale['setup']['gpus']} GPUs, a failure every {SCALE['failure_every_h']:g} h, "
          f"simulated in {scale_wall:.0f} s):")
    for row in scale["after_k_failures"][:2]:
        print("  after", row["failures"], "failure(s):", {k: round(v, 3) for k, v in row.items() if k != "failures"})
    print("  average over the trace:", {k: round(v, 3) for k, v in scale["time_average_over_trace"].items()})


if __name__ == "__main__":
    main()
