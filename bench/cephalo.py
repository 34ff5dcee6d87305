"""Uneven sharded data parallelism (Cephalo): predicted vs measured, in one command.

1. Planner, real device types (predicted): a 6.7B GPT on 4 L40S (48 GiB, fast) + 4 A100-80GB.
   Equal state shards do not fit an L40S; memory-proportional shards do. The sharded mode is
   also compared with the pipeline planner's best on two clusters.
2. CPU-emulated cluster, 4 gloo ranks: island ``fast`` (2 ranks) and ``slow`` (2 ranks, compute
   slowed 3x by sleeping, as ``HeteroTrainer._timed``). Memory is emulated by per-rank budgets:
   the fast ranks have room for 12% of the training state, the slow ones 45%.
   - speed: speed-proportional batch shares vs equal ones (same shards), predicted gain
     (perf model) next to measured gain (median iteration time, cases alternate A B A B);
   - memory: the equal-shard plan is refused by the fast ranks' budgets (predicted: planner
     infeasible; measured: MemoryBudgetError), the memory-proportional plan trains.

    python bench/cephalo.py [--iters 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_het.cluster import CATALOG, ClusterSpec, IslandEmulation, IslandSpec, LinkSpec, ModelSpec  # noqa: E402
from megatron_het.perf.flops import total_parameters  # noqa: E402
from megatron_het.perf.sharded import sharded_rank_memory  # noqa: E402
from megatron_het.planner.errors import InfeasibleError  # noqa: E402
from megatron_het.planner.sharded import compare_with_pipeline, plan_sharded  # noqa: E402
from megatron_het.platform.local_launch import run_local  # noqa: E402
from megatron_het.runtime.train_config import TrainConfig  # noqa: E402
from megatron_het.sharding import ShardedPlan  # noqa: E402

OUT = os.path.join(ROOT, "bench", "results", "cephalo.json")
GPT_6_7B = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=2048, vocab_size=50257,
                     name="gpt-6.7b")
GPT_1_3B = ModelSpec(num_layers=24, hidden_size=2048, num_attention_heads=32, seq_length=2048, vocab_size=50257,
                     name="gpt-1.3b")
CPU_MODEL = ModelSpec(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=256)
CPU_BATCH = 16
SLOWDOWN = 3.0
ROOM = (0.12, 0.12, 0.45, 0.45)  # emulated free memory per rank, as a share of the training state
WARMUP = 1


def gpu_cluster(a: str, b: str, bw: float) -> ClusterSpec:
    return ClusterSpec(islands=(IslandSpec(name="a", device=CATALOG[a], nodes=1, gpus_per_node=4),
                                IslandSpec(name="b", device=CATALOG[b], nodes=1, gpus_per_node=4)),
                       links=(LinkSpec(between=("a", "b"), bandwidth_gbps=bw),))


def cpu_cluster() -> ClusterSpec:
    cpu = CATALOG["CPU"]
    return ClusterSpec(islands=(IslandSpec(name="fast", device=cpu, nodes=1, gpus_per_node=2),
                                IslandSpec(name="slow", device=cpu, nodes=1, gpus_per_node=2)),
                       links=(LinkSpec(between=("fast", "slow"), bandwidth_gbps=100),),
                       emulation={"fast": IslandEmulation(slowdown=1.0), "slow": IslandEmulation(slowdown=SLOWDOWN)})


def cpu_budgets() -> list[int]:
    p = total_parameters(CPU_MODEL)  # vocab 256 is already padded: the runtime's exact count
    base = sharded_rank_memory(CPU_MODEL, shard_fraction=0.0, micro_batch_size=1, recompute=False,
                               precision="fp32", overhead_bytes=0, num_parameters=p).total_bytes
    return [int(base + 12 * p * room) for room in ROOM]


def _plan_cpu(**kw) -> ShardedPlan:
    return plan_sharded(CPU_MODEL, cpu_cluster(), global_batch_size=CPU_BATCH, micro_batch_sizes=(1,),
                        recompute_options=(False,), precision="fp32", overhead_bytes=0,
                        capacity_bytes=cpu_budgets(), **kw)


def _rank(rank, world_size, cases, train, iters, rounds):
    from functools import partial

    import torch
    import torch.distributed as dist

    from megatron_het.platform import enable_cpu_backend
    from megatron_het.sharding.budget import MemoryBudgetError
    from megatron_het.sharding.trainer import ShardedTrainer

    enable_cpu_backend()
    batch = partial(_batch, train.seed)
    out = {name: {"elapsed": [], "loss": None, "error": None, "compute": [], "fixed": []} for name, _ in cases}
    for _ in range(rounds):
        for name, plan_dict in cases:  # alternate cases so machine noise hits all of them
            plan = ShardedPlan.from_dict(plan_dict)
            trainer = None
            try:
                trainer = ShardedTrainer(model=CPU_MODEL, plan=plan, train=train, batch_fn=batch,
                                         cluster=cpu_cluster(), memory_budget_bytes=cpu_budgets())
            except MemoryBudgetError as err:
                out[name]["error"] = str(err)
            ok = torch.tensor([0 if trainer is None else 1])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank skips the case if any rank refused it
            if not int(ok):
                continue
            logs = trainer.run(WARMUP + iters).iterations
            out[name]["elapsed"] += [log.elapsed_s for log in logs[WARMUP:]]
            out[name]["compute"] += [log.compute_s - log.emulated_s for log in logs[WARMUP:]]  # real compute
            out[name]["fixed"] += [log.comm_s + log.optimizer_s for log in logs[WARMUP:]]
            out[name]["loss"] = logs[-1].lm_loss
    return out


def _batch(seed, iteration, indices):
    from megatron_het.data.synthetic import synthetic_batch

    return synthetic_batch(seed=seed, iteration=iteration, indices=indices, seq_length=CPU_MODEL.seq_length,
                           vocab_size=CPU_MODEL.vocab_size)


def planner_figures() -> dict:
    cluster = gpu_cluster("L40S", "A100-80GB", 100)
    fig: dict = {}
    try:
        plan_sharded(GPT_6_7B, cluster, global_batch_size=64, shard_policy="equal")
        fig["equal_shards"] = "fits"
    except InfeasibleError as err:
        fig["equal_shards"] = "infeasible: " + str(err).split(";")[0]
    for policy in ("memory", "balanced"):
        p = plan_sharded(GPT_6_7B, cluster, global_batch_size=64, shard_policy=policy)
        fig[f"{policy}_shards"] = {"fits": p.predicted["fits"], "iteration_time_s": p.predicted["iteration_time_s"],
                                   "shard_fraction_l40s": p.ranks[0].shard_fraction,
                                   "shard_fraction_a100": p.ranks[4].shard_fraction,
                                   "samples_l40s": p.ranks[0].samples, "samples_a100": p.ranks[4].samples}
    comparisons = {}
    for label, model, c in (("gpt-1.3b on 4 H100 + 4 H200, 2400 Gbit/s", GPT_1_3B, gpu_cluster("H100-SXM", "H200", 2400)),
                            ("gpt-1.3b on 4 L40S + 4 A100-80GB, 100 Gbit/s", GPT_1_3B, cluster),
                            ("gpt-6.7b on 4 L40S + 4 A100-80GB, 100 Gbit/s", GPT_6_7B, cluster)):
        cmp = compare_with_pipeline(model, c, global_batch_size=64)
        comparisons[label] = {"winner": cmp.winner, "sharded_time_s": cmp.sharded_time_s,
                              "pipeline_time_s": cmp.pipeline_time_s, "speedup_sharded_vs_pipeline": cmp.speedup}
    fig["vs_pipeline_planner"] = comparisons
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=6, help="timed iterations per case per round")
    ap.add_argument("--rounds", type=int, default=2, help="A B A B rounds")
    args = ap.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)

    planner = planner_figures()
    speed = _plan_cpu(shard_policy="memory")
    equal_batch = _plan_cpu(shard_policy="memory", batch_policy="equal")
    try:
        _plan_cpu(shard_policy="equal")
        equal_state_predicted = "fits"
    except InfeasibleError as err:
        equal_state_predicted = "infeasible: " + str(err).split(";")[0]
    equal_state = ShardedPlan.from_dict({**speed.to_dict(), "ranks": [
        {**r, "shard_fraction": 0.25} for r in speed.to_dict()["ranks"]]})
    cases = [("speed_batches", speed.to_dict()), ("equal_batches", equal_batch.to_dict()),
             ("equal_shards", equal_state.to_dict())]
    train = TrainConfig(micro_batch_size=1, global_batch_size=CPU_BATCH, train_iters=WARMUP + args.iters, lr=1e-3)
    per_rank = run_local(4, _rank, (cases, train, args.iters, args.rounds), timeout_s=3600)

    def median_iter(name):  # iteration time = slowest rank's, then the median over iterations
        per_iter = zip(*(out[name]["elapsed"] for out in per_rank))
        return statistics.median(max(times) for times in per_iter)

    t_speed, t_equal = median_iter("speed_batches"), median_iter("equal_batches")
    p_speed, p_equal = speed.predicted["iteration_time_s"], equal_batch.predicted["iteration_time_s"]
    # Calibrated prediction: the perf model's formula (slowest rank's compute + collectives + optimizer)
    # with two measured constants from the equal-batch run: seconds per sample of real compute on
    # an undisturbed rank, and the fixed per-iteration cost on the slowest rank (no waiting there).
    eq = equal_batch.samples_per_rank
    t_sample = statistics.median(c / eq[r] for r, out in enumerate(per_rank) for c in out["equal_batches"]["compute"])
    fixed = statistics.median(min(f) for f in zip(*(out["equal_batches"]["fixed"] for out in per_rank)))
    slow = [cpu_cluster().slowdown(r.island) for r in speed.ranks]

    def calibrated(plan):
        return max(s * t_sample * k for s, k in zip(plan.samples_per_rank, slow)) + fixed

    c_speed, c_equal = calibrated(speed), calibrated(equal_batch)
    refused = {r: out["equal_shards"]["error"] for r, out in enumerate(per_rank) if out["equal_shards"]["error"]}
    emulated = {
        "cluster": f"fast: 2 ranks, slow: 2 ranks at {SLOWDOWN}x (sleep emulation), gloo",
        "model": "4 layers, h128, seq 64, vocab 256", "global_batch_size": CPU_BATCH,
        "memory_room_share_of_state": list(ROOM), "budgets_bytes": cpu_budgets(),
        "speed_plan": {"samples": list(speed.samples_per_rank), "shard_fractions": list(speed.shard_fractions)},
        "equal_batch_plan": {"samples": list(equal_batch.samples_per_rank)},
        "predicted_s": {"speed_batches": p_speed, "equal_batches": p_equal},
        "measured_s": {"speed_batches": t_speed, "equal_batches": t_equal},
        "predicted_gain": p_equal / p_speed, "measured_gain": t_equal / t_speed,
        "calibrated_predicted_s": {"speed_batches": c_speed, "equal_batches": c_equal},
        "calibrated_predicted_gain": c_equal / c_speed,
        "calibration": {"compute_s_per_sample": t_sample, "fixed_s_per_iteration": fixed},
        "equal_shards_predicted": equal_state_predicted,
        "equal_shards_measured": (f"refused by ranks {sorted(refused)}: " + next(iter(refused.values())).split(".")[0]
                                  if refused else "ran"),
        "memory_plan_final_loss": per_rank[0]["speed_batches"]["loss"],
    }
    figures = {"planner": planner, "emulated": emulated,
               "wall_s": round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1)}
    targets = {"memory": "equal shards infeasible where memory-proportional ones fit (planner and runtime)",
               "speed": "measured gain of speed-proportional batches within 25% of the calibrated predicted gain "
                        "(the analytic CPU catalog entry is not calibrated to this machine)"}

    print(f"{'case':<34} {'analytic':>10} {'calibrated':>10} {'measured':>10}")
    print(f"{'speed batches: iteration s':<34} {p_speed:>10.4f} {c_speed:>10.4f} {t_speed:>10.4f}")
    print(f"{'equal batches: iteration s':<34} {p_equal:>10.4f} {c_equal:>10.4f} {t_equal:>10.4f}")
    print(f"{'gain (equal / speed)':<34} {p_equal / p_speed:>10.2f} {c_equal / c_speed:>10.2f} "
          f"{t_equal / t_speed:>10.2f}")
    print(f"{'equal shards (emulated budgets)':<34} {equal_state_predicted[:10]:>10} {'':>10} "
          f"{'refused' if refused else 'ran':>10}")
    print(f"planner, 6.7B on L40S + A100-80GB: equal shards {planner['equal_shards'][:10]}; memory shards fit="
          f"{planner['memory_shards']['fits']} ({planner['memory_shards']['iteration_time_s']:.2f} s), balanced "
          f"{planner['balanced_shards']['iteration_time_s']:.2f} s")
    for label, c in planner["vs_pipeline_planner"].items():
        print(f"vs pipeline planner, {label}: winner {c['winner']} (sharded {c['sharded_time_s']}, "
              f"pipeline {c['pipeline_time_s']:.3f} s)")
    import torch

    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump({"figures": figures, "targets": targets, "command": "python bench/cephalo.py",
                   "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                               "torch": torch.__version__, "platform": platform.platform()},
                   "date": started.isoformat(timespec="seconds")}, f, indent=2)
        f.write("\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
