"""Fidelity of the performance model on this machine: predicted vs measured iteration time.

For several plans on the CPU-emulated two-type cluster (examples/clusters/cpu-demo.yaml: island
`fast`, island `slow` emulated 2x slower, 2 ranks each), with a per-layer profile measured here by
tools/profile.py, predict the iteration time with megatron_het.perf.predict and measure it with the
heterogeneous runtime (median over iterations after warm-up, all plans in one 4-process spawn,
rounds alternating). Target: median absolute error <= 10%; the worst is reported.

    python bench/fidelity.py [--iters 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_het.cluster import ModelSpec, load_cluster  # noqa: E402
from megatron_het.plan import Plan, ReplicaPlan, StagePlan  # noqa: E402
from megatron_het.platform.local_launch import run_local  # noqa: E402
from megatron_het.runtime.train_config import TrainConfig  # noqa: E402

MODEL = ModelSpec(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1000)
CLUSTER = os.path.join(ROOT, "examples/clusters/cpu-demo.yaml")
PROFILE = os.path.join(ROOT, "bench/results/fidelity_cpu_profile.json")
WARMUP = 2


def _s(island, rank, layers):
    return StagePlan(island=island, device_type="CPU", ranks=(rank,), layers=layers)


def plans(train: TrainConfig) -> dict[str, Plan]:
    def plan(*replicas):
        return Plan(replicas=tuple(ReplicaPlan(stages=tuple(s), num_micro_batches=m) for s, m in replicas),
                    micro_batch_size=train.micro_batch_size, global_batch_size=train.global_batch_size)

    return {
        "pp4_fast_fast_slow_slow": plan(([_s("fast", 0, (0, 3)), _s("fast", 1, (3, 6)), _s("slow", 2, (6, 7)),
                                          _s("slow", 3, (7, 8))], 8)),
        "2x_pp2_equal_layers": plan(([_s("fast", 0, (0, 4)), _s("slow", 2, (4, 8))], 4),
                                    ([_s("fast", 1, (0, 4)), _s("slow", 3, (4, 8))], 4)),
        "2x_pp2_balanced_layers": plan(([_s("fast", 0, (0, 5)), _s("slow", 2, (5, 8))], 4),
                                       ([_s("fast", 1, (0, 5)), _s("slow", 3, (5, 8))], 4)),
        "dp4_equal": plan(([_s("fast", 0, (0, 8))], 2), ([_s("fast", 1, (0, 8))], 2),
                          ([_s("slow", 2, (0, 8))], 2), ([_s("slow", 3, (0, 8))], 2)),
        "dp4_by_speed": plan(([_s("fast", 0, (0, 8))], 3), ([_s("fast", 1, (0, 8))], 3),
                             ([_s("slow", 2, (0, 8))], 1), ([_s("slow", 3, (0, 8))], 1)),
        "fast_pp2_slow_pp2": plan(([_s("fast", 0, (0, 4)), _s("fast", 1, (4, 8))], 5),
                                  ([_s("slow", 2, (0, 4)), _s("slow", 3, (4, 8))], 3)),
    }


def _batch(seed, iteration, indices):
    from megatron_het.data.synthetic import synthetic_batch

    return synthetic_batch(seed=seed, iteration=iteration, indices=indices, seq_length=MODEL.seq_length,
                           vocab_size=MODEL.vocab_size)


def _rank(rank, world_size, train, names, rounds):
    from functools import partial

    import torch.distributed as dist

    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    enable_cpu_backend()
    cluster = load_cluster(CLUSTER)
    table = plans(train)
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        for name in names:
            dist.barrier()
            trainer = HeteroTrainer(model=MODEL, plan=table[name], train=train, batch_fn=partial(_batch, train.seed),
                                    cluster=cluster)
            times[name].extend(log.elapsed_s for log in trainer.run().iterations[WARMUP:])
    return times


def measure_profile() -> None:
    subprocess.run([sys.executable, os.path.join(ROOT, "tools/profile.py"), "--num-layers", "2",
                    "--hidden-size", str(MODEL.hidden_size), "--num-attention-heads", str(MODEL.num_attention_heads),
                    "--seq-length", str(MODEL.seq_length), "--micro-batch-sizes", "2", "--device", "CPU",
                    "--output", PROFILE], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reuse-profile", action="store_true", help="use the existing profile file")
    args = ap.parse_args()
    if not (args.reuse_profile and os.path.exists(PROFILE)):
        measure_profile()
    from megatron_het.perf import load_profile, predict

    profile = load_profile(PROFILE)
    cluster = load_cluster(CLUSTER)
    train = TrainConfig(micro_batch_size=2, global_batch_size=16, train_iters=args.iters, lr=1e-4)
    table = plans(train)
    predicted = {n: predict(p, MODEL, cluster, profile=profile).iteration_time_s for n, p in table.items()}
    per_rank = run_local(4, _rank, (train, list(table), args.rounds), timeout_s=3600)
    measured = {n: statistics.median(max(v) for v in zip(*(r[n] for r in per_rank))) for n in table}
    errors = {n: (predicted[n] - measured[n]) / measured[n] for n in table}
    abs_err = sorted(abs(e) for e in errors.values())
    median_err, worst = statistics.median(abs_err), max(abs_err)
    print(f"{'plan':26s} {'predicted s':>12s} {'measured s':>11s} {'error':>8s}")
    for n in table:
        print(f"{n:26s} {predicted[n]:12.4f} {measured[n]:11.4f} {100 * errors[n]:7.1f}%")
    print(f"\nmedian |error| {100 * median_err:.1f}% (target <= 10%), worst {100 * worst:.1f}%")
    result = {
        "figures": {"predicted_s": predicted, "measured_s": measured, "relative_error": errors,
                    "median_abs_error": median_err, "worst_abs_error": worst},
        "targets": {"median_abs_error": "<= 0.10"},
        "command": "python bench/fidelity.py " + " ".join(sys.argv[1:]),
        "setup": {"model": MODEL.__dict__, "cluster": "examples/clusters/cpu-demo.yaml", "profile": PROFILE,
                  "micro_batch_size": 2, "global_batch_size": 16, "iters": args.iters, "warmup": WARMUP,
                  "rounds": args.rounds},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    with open(os.path.join(ROOT, "bench", "results", "fidelity.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
