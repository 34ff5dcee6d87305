"""Runtime overhead and the value of speed-balanced plans, measured side by side in one run.

1. Same homogeneous plan (TP=2 x PP=2 on 4 gloo ranks): megatron-het's runtime vs plain megatron-core
   (DDP, get_forward_backward_func 1F1B, megatron optimizer). Target: throughput ratio >= 0.97.
2. Emulated two-type cluster (examples/clusters/cpu-demo.yaml: island `fast` slowdown 1.0, `slow`
   2.0, 2 ranks each): a speed-balanced plan vs an equal split, for a pipeline (layers split by
   speed vs equally) and for data parallelism (micro-batches split by speed vs equally).

Cases alternate (A B A B ...) inside one 4-process spawn so machine noise hits both; the figure
per case is the median iteration time after warm-up (max over ranks of each iteration).

    python bench/runtime_overhead.py [--iters 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from harness import ROOT, cpu_rank, slowest, stamp, synthetic_batches, write_result

from megatron_het.cluster import ModelSpec, load_cluster
from megatron_het.model.groups import BlockShape
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local
from megatron_het.train.config import TrainConfig

MODEL = ModelSpec(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1000)
WARMUP = 2


def _stage(island, ranks, layers):
    return StagePlan(island=island, device_type="CPU", ranks=tuple(ranks), layers=layers)


def _plan(train, *replicas):
    return Plan(replicas=tuple(ReplicaPlan(stages=tuple(s), num_micro_batches=m) for s, m in replicas),
                micro_batch_size=train.micro_batch_size, global_batch_size=train.global_batch_size)


def cases(train: TrainConfig):
    m = train.global_batch_size // train.micro_batch_size
    homogeneous = _plan(train, ([_stage("fast", [0, 1], (0, 4)), _stage("fast", [2, 3], (4, 8))], m))
    return {
        "megatron_tp2pp2": ("megatron", BlockShape(tp=2, pp=2, dp=1), False),
        "runtime_tp2pp2": ("runtime", homogeneous, False),
        # pipeline fast(TP2) -> slow(TP2): equal layers vs layers by speed (slow is 2x slower)
        "pipeline_equal": ("runtime", _plan(train, ([_stage("fast", [0, 1], (0, 4)),
                                                      _stage("slow", [2, 3], (4, 8))], m)), True),
        "pipeline_balanced": ("runtime", _plan(train, ([_stage("fast", [0, 1], (0, 5)),
                                                         _stage("slow", [2, 3], (5, 8))], m)), True),
        # two replicas, one per island: equal micro-batches vs micro-batches by speed
        "dp_equal": ("runtime", _plan(train, ([_stage("fast", [0, 1], (0, 8))], m // 2),
                                      ([_stage("slow", [2, 3], (0, 8))], m // 2)), True),
        "dp_balanced": ("runtime", _plan(train, ([_stage("fast", [0, 1], (0, 8))], m * 5 // 8),
                                         ([_stage("slow", [2, 3], (0, 8))], m - m * 5 // 8)), True),
    }


def _rank(rank, world_size, train, order, rounds, cluster_path):
    import torch.distributed as dist

    from megatron_het.runtime.hetero_trainer import HeteroTrainer, plan_padded_vocab
    from megatron_het.runtime.megatron_trainer import train_megatron_block

    cpu_rank(threads=None)
    cluster = load_cluster(cluster_path)
    batch = synthetic_batches(MODEL, train.seed)
    table = cases(train)
    vocab = plan_padded_vocab(MODEL, table["runtime_tp2pp2"][1])
    times: dict[str, list[float]] = {name: [] for name in order}
    for _ in range(rounds):
        for name in order:
            kind, what, emulated = table[name]
            dist.barrier()
            if kind == "megatron":
                res = train_megatron_block(model=MODEL, train=train, shape=what, batch_fn=batch, padded_vocab=vocab)
            else:
                trainer = HeteroTrainer(model=MODEL, plan=what, train=train, batch_fn=batch,
                                        cluster=cluster if emulated else None, padded_vocab=vocab,
                                        slowdown=None if emulated else 1.0)
                res = trainer.run()
            times[name].extend(log.elapsed_s for log in res.iterations[WARMUP:])
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=8, help="iterations per case per round (first 2 are warm-up)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    train = TrainConfig(micro_batch_size=2, global_batch_size=16, train_iters=args.iters, lr=1e-4)
    order = list(cases(train))
    cluster_path = ROOT / "examples/clusters/cpu-demo.yaml"
    per_rank = run_local(4, _rank, (train, order, args.rounds, cluster_path), timeout_s=3600)
    # Per iteration, the slowest rank's time (ranks finish an iteration together at its all-reduce).
    median = {name: statistics.median(slowest(r[name] for r in per_rank)) for name in order}
    tps = {name: train.global_batch_size * MODEL.seq_length / t for name, t in median.items()}
    ratios = {
        "runtime_vs_megatron_homogeneous": tps["runtime_tp2pp2"] / tps["megatron_tp2pp2"],
        "pipeline_balanced_vs_equal": tps["pipeline_balanced"] / tps["pipeline_equal"],
        "dp_balanced_vs_equal": tps["dp_balanced"] / tps["dp_equal"],
    }
    targets = {"runtime_vs_megatron_homogeneous": ">= 0.97",
               "pipeline_balanced_vs_equal": "> 1 (ideal 8/6 = 1.33 with 2x slowdown, 5+3 vs 4+4 layers)",
               "dp_balanced_vs_equal": "> 1 (ideal 8/6 = 1.33 with 2x slowdown, 5:3 vs 4:4 micro-batches)"}
    print(f"{'case':22s} {'median s/it':>12s} {'tokens/s':>10s}")
    for name in order:
        print(f"{name:22s} {median[name]:12.4f} {tps[name]:10.0f}")
    print()
    for k, v in ratios.items():
        print(f"{k:36s} {v:6.3f}   target {targets[k]}")
    write_result("runtime_overhead.json", {
        "figures": {"median_iteration_s": median, "tokens_per_s": tps, "ratios": ratios},
        "targets": targets,
        "setup": {"model": MODEL.__dict__, "micro_batch_size": train.micro_batch_size,
                  "global_batch_size": train.global_batch_size, "iters_per_round": args.iters,
                  "warmup": WARMUP, "rounds": args.rounds, "ranks": 4},
        **stamp(perf=False),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
