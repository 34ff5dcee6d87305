"""Predicted vs measured bytes per rank: by component (issue #15), and the allocation peak of each
phase of a run (issue #36).

Each case is a 4-rank plan of a small GPT trained for 2 iterations on CPU (gloo), then saved and
loaded; every rank reports what it holds (``runtime/memory_report.py``: parameters, gradients,
optimizer state by walking its tensors; activations saved for backward by saved-tensor hooks, peak
over the iteration) and ``perf.memory.rank_memory`` predicts the same components for the same plan,
precision, recompute setting and schedule. The whole case runs under the allocation timeline
(``platform/allocation_peak``: every allocation and free torch's allocator makes, from torch's
profiler), which gives each phase's peak (construction, forward/backward, reduce, optimizer step,
save, load), predicted by ``perf.phase_memory.rank_phase_peaks``. Rows are distinct (case, stage)
configurations. Targets: every component within 5%, per-rank held peak (sum) within 10%, every
phase's allocation peak within 10%.

    python bench/memory.py            # ~5 min on 2 shared cores
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

from harness import cpu_rank, stamp, synthetic_batches, write_result

from megatron_het.cluster import ModelSpec
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local
from megatron_het.train.config import TrainConfig

MODEL = ModelSpec(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=512,
                  max_position_embeddings=128)
PADDED_VOCAB = 512  # a multiple of 128 x every TP size used: no padding rows
MICRO, MICRO_BATCHES = 2, 4
TARGET_COMPONENT, TARGET_PEAK, TARGET_PHASE = 0.05, 0.10, 0.10
SMALL_BUCKET = 50_000  # --ddp-bucket-size below the model's 0.9M parameters: many buckets per group


def _stage(ranks, layers, recompute=False, recompute_num_layers=0) -> StagePlan:
    return StagePlan(island="cpu", device_type="CPU", ranks=tuple(ranks), layers=layers, recompute=recompute,
                     recompute_num_layers=recompute_num_layers)


def _plan(*replicas, schedule="1f1b", precision="fp32", dist=False, bucket=None) -> Plan:
    n = sum(m for _, m in replicas)
    return Plan(replicas=tuple(ReplicaPlan(stages=tuple(s), num_micro_batches=m) for s, m in replicas),
                micro_batch_size=MICRO, global_batch_size=MICRO * n, schedule=schedule, precision=precision,
                use_distributed_optimizer=dist), bucket


def cases() -> list[tuple[str, tuple[Plan, int | None]]]:
    pp3 = [_stage([0], (0, 1)), _stage([1, 2], (1, 3)), _stage([3], (3, 4))]  # first TP1, middle TP2, last TP1
    pp3_rc = [_stage([0], (0, 1)), _stage([1, 2], (1, 3), recompute=True), _stage([3], (3, 4), recompute=True)]
    # Megatron's block method: the middle stage recomputes the first of its 2 layers only
    pp3_block = [_stage([0], (0, 1)), _stage([1, 2], (1, 3), recompute=True, recompute_num_layers=1), _stage([3], (3, 4))]
    dp2 = ([_stage([0], (0, 2)), _stage([1], (2, 4))], 2), ([_stage([2, 3], (0, 4))], 2)
    dp4 = tuple(([_stage([r], (0, 4))], 1) for r in range(4))  # data parallel only (a first GPU job's plan)
    return [
        ("pp3 fp32 1f1b", _plan((pp3, MICRO_BATCHES))),
        ("pp3 bf16 1f1b", _plan((pp3, MICRO_BATCHES), precision="bf16")),
        ("pp3 fp32 recompute 1f1b", _plan((pp3_rc, MICRO_BATCHES))),
        ("pp3 fp32 block recompute 1f1b", _plan((pp3_block, MICRO_BATCHES))),
        ("pp3 fp32 gpipe", _plan((pp3, MICRO_BATCHES), schedule="gpipe")),
        ("tp4 bf16", _plan(([_stage([0, 1, 2, 3], (0, 4))], MICRO_BATCHES), precision="bf16")),
        ("dp2 fp32 plain", _plan(*dp2)),
        ("dp2 fp32 distopt", _plan(*dp2, dist=True)),
        ("dp2 bf16 distopt", _plan(*dp2, precision="bf16", dist=True)),
        ("dp2 bf16 distopt buckets", _plan(*dp2, precision="bf16", dist=True, bucket=SMALL_BUCKET)),
        ("dp4 bf16 distopt", _plan(*dp4, precision="bf16", dist=True)),
        ("dp4 bf16 distopt buckets", _plan(*dp4, precision="bf16", dist=True, bucket=SMALL_BUCKET)),
        ("dp4 fp32 distopt buckets", _plan(*dp4, dist=True, bucket=SMALL_BUCKET)),
        ("dp4 bf16 plain", _plan(*dp4, precision="bf16")),
    ]


def _rank(rank, world_size, plans, iters, save_dir):
    import gc
    import os

    import torch
    import torch.distributed as dist

    from megatron_het.checkpoint.dist_ckpt import iteration_dir
    from megatron_het.platform.allocation_peak import allocation_timeline
    from megatron_het.runtime.hetero_trainer import HeteroTrainer
    from megatron_het.runtime.memory_report import MemoryProbe

    cpu_rank(threads=None)
    batch = synthetic_batches(MODEL)
    out = {}
    for name, (plan, bucket) in plans:
        gc.collect()  # the previous case's tensors are freed before this timeline starts counting
        dist.barrier()
        train = TrainConfig(micro_batch_size=MICRO, global_batch_size=plan.global_batch_size, train_iters=iters,
                            lr=1e-3, bf16=plan.precision == "bf16", ddp_bucket_size=bucket)
        probe = MemoryProbe()
        save = os.path.join(save_dir, name.replace(" ", "_"))
        with allocation_timeline(torch.device("cpu")) as timeline:
            trainer = HeteroTrainer(model=MODEL, plan=plan, train=train, batch_fn=batch, padded_vocab=PADDED_VOCAB,
                                    hooks=probe)
            trainer.run()
            trainer.strategy.save_checkpoint(save, iters)
            trainer.strategy.load_checkpoint(iteration_dir(save, iters))
        out[name] = (probe.report(), {k: v.peak_bytes for k, v in timeline.phases.items()})
        del trainer
    return out


def _err(pred: int, meas: int) -> float:
    if meas == 0:
        return 0.0 if pred == 0 else float("inf")
    return (pred - meas) / meas


def main(argv=None) -> int:
    import tempfile

    from megatron_het.perf.memory import rank_memory
    from megatron_het.perf.phase_memory import PHASES, rank_phase_peaks
    from megatron_het.perf.predict import bucket_parameters
    from megatron_het.plan import rank_roles
    from megatron_het.runtime.grad_sync import checkpoint_writers
    from megatron_het.runtime.holdings import plan_holdings

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=2)
    args = parser.parse_args(argv)
    plans = cases()
    start = time.time()
    with tempfile.TemporaryDirectory() as save_dir:
        per_rank = run_local(4, _rank, (plans, args.iters, save_dir), timeout_s=3600)
    rows, seen = [], set()
    for name, (plan, bucket) in plans:
        roles = rank_roles(plan)
        holdings = plan_holdings(plan, MODEL, padded_vocab=PADDED_VOCAB)
        writers = checkpoint_writers(holdings)
        written = {r: sum(math.prod(h.full_shape) // (h.tp_size if h.partition_dim is not None else 1)
                          for h in holdings if h.rank == r and (h.name, r) in writers) for r in range(4)}
        for rank in range(4):
            role = roles[rank]
            key = (name, role.replica, role.stage)
            if key in seen:
                continue  # TP peers and identical ranks: one row per stage
            seen.add(key)
            meas, phases_meas = per_rank[rank][name]
            pred = rank_memory(MODEL, plan, rank, padded_vocab=PADDED_VOCAB)
            phases_pred = rank_phase_peaks(MODEL, plan, rank, padded_vocab=PADDED_VOCAB,
                                           bucket_numel=bucket or bucket_parameters(len(plan.replicas)),
                                           written_elements=written[rank])
            phases = {ph: {"predicted": phases_pred[ph], "measured": phases_meas[ph],
                           "error": _err(phases_pred[ph], phases_meas[ph])} for ph in PHASES}
            stage = plan.replicas[role.replica].stages[role.stage]
            where = "first" if role.stage == 0 else "last" if role.stage == role.num_stages - 1 else "middle"
            if role.num_stages == 1:
                where = "first+last"
            parts = {}
            for comp in ("parameters", "gradients", "optimizer", "activations"):
                pv, mv = getattr(pred, f"{comp}_bytes"), getattr(meas, f"{comp}_bytes")
                parts[comp] = {"predicted": pv, "measured": mv, "error": _err(pv, mv)}
            ptot = sum(v["predicted"] for v in parts.values())
            mtot = sum(v["measured"] for v in parts.values())
            rows.append({"case": name, "rank": rank, "replica": role.replica, "stage": where, "tp": stage.tp,
                         "precision": plan.precision, "recompute": stage.recompute,
                         "recompute_num_layers": stage.recompute_num_layers,
                         "distributed_optimizer": plan.use_distributed_optimizer, "schedule": plan.schedule,
                         "ddp_bucket_size": bucket, "phases": phases,
                         "components": parts, "peak": {"predicted": ptot, "measured": mtot, "error": _err(ptot, mtot)},
                         "activations_per_microbatch_measured": meas.activations_per_microbatch_bytes})
    worst_comp = max(abs(v["error"]) for r in rows for v in r["components"].values())
    worst_peak = max(abs(r["peak"]["error"]) for r in rows)
    kib = 1024
    print(f"{'case':26} {'rank':>4} {'stage':>10} {'tp':>2} | " + " | ".join(
        f"{c[:5]} pred/meas KiB (err)" for c in ("param", "grads", "optim", "activ")) + " | peak err")
    for r in rows:
        cells = " | ".join(f"{v['predicted'] / kib:8.1f}/{v['measured'] / kib:8.1f} ({100 * v['error']:+5.1f}%)"
                           for v in r["components"].values())
        print(f"{r['case']:26} {r['rank']:>4} {r['stage']:>10} {r['tp']:>2} | {cells} | {100 * r['peak']['error']:+5.1f}%")
    print(f"\n{'case':26} {'rank':>4} {'stage':>10} | " + " | ".join(f"{ph[:14]:>14} pred/meas KiB (err)"
                                                                  for ph in PHASES))
    for r in rows:
        cells = " | ".join(f"{v['predicted'] / kib:9.1f}/{v['measured'] / kib:9.1f} ({100 * v['error']:+5.1f}%)"
                           for v in r["phases"].values())
        print(f"{r['case']:26} {r['rank']:>4} {r['stage']:>10} | {cells}")
    worst_phase = max(abs(v["error"]) for r in rows for v in r["phases"].values())
    met_c, met_p, met_ph = worst_comp <= TARGET_COMPONENT, worst_peak <= TARGET_PEAK, worst_phase <= TARGET_PHASE
    print(f"{len(rows)} configurations; worst component error {100 * worst_comp:.2f}% (target 5%: "
          f"{'met' if met_c else 'NOT met'}), worst held peak error {100 * worst_peak:.2f}% (target 10%: "
          f"{'met' if met_p else 'NOT met'}), worst phase peak error {100 * worst_phase:.2f}% (target 10%: "
          f"{'met' if met_ph else 'NOT met'}); {time.time() - start:.0f} s")
    write_result("memory.json", {
        "benchmark": "memory", **stamp(), "model": dataclasses.asdict(MODEL),
        "micro_batch_size": MICRO, "targets": {"component": TARGET_COMPONENT, "peak": TARGET_PEAK,
                                               "phase": TARGET_PHASE},
        "worst_component_error": worst_comp, "worst_peak_error": worst_peak, "worst_phase_error": worst_phase,
        "component_target_met": met_c, "peak_target_met": met_p, "phase_target_met": met_ph, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
