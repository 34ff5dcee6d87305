"""Predict iteration time, throughput and memory of a plan (or a homogeneous Megatron configuration).

    python tools/predict.py --cluster C.yaml --model M.yaml --plan plan.json [--json] [--trace]
    python tools/predict.py --cluster C.yaml --model M.yaml --tp 2 --pp 2 --dp 2 \
        --micro-batch-size 1 --global-batch-size 32 [--virtual-pipeline-size 2] [--recompute-activations] \
        [--recompute-num-layers N] \
        [--bf16 | --fp16 | --fp32 | --tf32 | --fp8]

The second form needs a one-island cluster; the two forms do not mix. Precision: Megatron's flags
(--bf16, --fp16, --fp8 for Transformer Engine fp8 GEMMs; --fp32 is Megatron's default without a flag,
--tf32 the same with tensor-core matmuls); this tool prices bf16 when none is given, as plans written
before precision was recorded were. A plan carries its own precision. After the headline figures the
tool prints where the iteration goes (GEMMs by kind, fixed per-kernel costs, exposed communication,
bubble, optimizer; megatron_het/perf/breakdown.py). ``--trace`` then draws each distinct replica's
simulated timeline, one row per stage: the action lists the runtime executes for the plan's schedule
(F/B/W per micro-batch, ``.c`` for model chunk c), timed by the model. ``--phases`` prints each
stage's allocation peak in every phase of a run (construction, forward/backward, gradient reduction,
optimizer step, save, load; ``perf/phase_memory.py``) with ``--ddp-bucket-size`` buckets, against the
device's memory: the phase a first GPU job would run out of memory in. Errors are one line on stderr
with exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import replace

from megatron_het.cli.output import quiet_on_broken_pipe
from megatron_het.cli.profiles import warn_unused_profiles
from megatron_het.cluster import load_cluster, load_model
from megatron_het.errors import UserError
from megatron_het.perf import load_profile
from megatron_het.perf.bounds import check_global_batch_size
from megatron_het.perf.breakdown import PART_LABELS, explain
from megatron_het.plan import Plan, PlanError, homogeneous_plan, layer_split, validate_plan
from megatron_het.plan.types import PLAN_ATTENTIONS
from megatron_het.planner.sharded import predict_sharded
from megatron_het.sharding.plan import ShardedPlan, load_any_plan, validate_sharded_plan


def _homogeneous(args, model, cluster) -> Plan:
    if len(cluster.islands) != 1:
        raise PlanError(field="--cluster", value=list(cluster.island_names),
                        problem=f"the --tp/--pp/--dp form needs a one-island cluster, this one has "
                                f"{len(cluster.islands)} islands",
                        fix="pass --plan PLAN.json for a heterogeneous cluster, or a one-island cluster file")
    island = cluster.islands[0]
    counts = None
    if model.num_layers % args.pp:
        counts = [b - a for a, b in layer_split(model.num_layers, [1.0] * args.pp)]
    plan = homogeneous_plan(tp=args.tp, pp=args.pp, dp=args.dp, num_layers=model.num_layers,
                            micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                            island=island.name, device_type=island.device.name, layers_per_stage=counts)
    v = 1 if args.virtual_pipeline_size is None else args.virtual_pipeline_size
    partial = args.recompute_num_layers or 0
    replicas = tuple(replace(r, stages=tuple(replace(s, recompute=args.recompute_activations or partial > 0,
                                                     recompute_num_layers=partial) for s in r.stages))
                     for r in plan.replicas)
    return replace(plan, replicas=replicas, schedule="interleaved" if v > 1 else "1f1b", virtual_pipeline_size=v,
                   sequence_parallel=args.sequence_parallel, use_distributed_optimizer=args.use_distributed_optimizer,
                   precision=args.precision or "bf16")


@quiet_on_broken_pipe
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="predict.py", description=__doc__.split("\n")[0])
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--plan", help="plan JSON (from tools/plan.py or hand-written)")
    parser.add_argument("--tp", type=int)
    parser.add_argument("--pp", type=int)
    parser.add_argument("--dp", type=int)
    parser.add_argument("--micro-batch-size", type=int)
    parser.add_argument("--global-batch-size", type=int)
    parser.add_argument("--virtual-pipeline-size", type=int, default=None, help="homogeneous form only (default 1)")
    parser.add_argument("--recompute-activations", action="store_true", help="full recomputation")
    parser.add_argument("--recompute-num-layers", type=int, default=None, metavar="N",
                        help="full recomputation of only the first N layers of each stage (Megatron's "
                             "--recompute-granularity full --recompute-method block --recompute-num-layers N)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    prec = parser.add_mutually_exclusive_group()
    for flag, value, text in (("--bf16", "bf16", "bf16 mixed precision"), ("--fp16", "fp16", "fp16 mixed precision"),
                              ("--fp32", "fp32", "fp32 (Megatron's default)"),
                              ("--tf32", "tf32", "fp32 storage, TF32 tensor-core matmuls"),
                              ("--fp8", "fp8", "Transformer Engine fp8 GEMMs, bf16 elsewhere")):
        prec.add_argument(flag, dest="precision", action="store_const", const=value, help=text)
    parser.add_argument("--profile", action="append", default=[],
                        help="profile JSON (repeatable): measured layers, or a tools/calibrate.py compute model")
    parser.add_argument("--attention", choices=PLAN_ATTENTIONS, default=None,
                        help="the attention kernel to price: fused (flash: transformer-engine or torch SDPA) or "
                             "unfused (s x s scores held); default: the plan's record, else fused on GPUs. With "
                             "--plan it may add the record but not contradict it")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--trace", action="store_true",
                        help="also draw each replica's simulated schedule (the runtime's action lists) as a grid")
    parser.add_argument("--phases", action="store_true",
                        help="also print each stage's allocation peak in every phase of a run (construction, "
                             "forward/backward, reduce, step, save, load) against the device's memory")
    parser.add_argument("--ddp-bucket-size", type=int, default=None, metavar="N",
                        help="gradient bucket for --phases, as pretrain_gpt.py's flag (default: megatron-core's "
                             "max(40M, 1M x replicas))")
    args = parser.parse_args(argv)
    homog = ("tp", "pp", "dp", "micro_batch_size", "global_batch_size")
    if args.plan is None and any(getattr(args, k) is None for k in homog):
        parser.error("pass --plan, or all of --tp --pp --dp --micro-batch-size --global-batch-size")
    if args.virtual_pipeline_size is not None and args.virtual_pipeline_size < 1:
        parser.error(f"--virtual-pipeline-size must be >= 1 (model chunks per pipeline stage; 1 = no interleaving), "
                     f"got {args.virtual_pipeline_size}")
    if args.plan is not None:  # the plan fixes every one of these; a flag beside it would be ignored
        given = [f"--{k.replace('_', '-')}" for k in (*homog, "virtual_pipeline_size", "recompute_activations",
                                                    "recompute_num_layers", "sequence_parallel",
                                                    "use_distributed_optimizer")
                 if getattr(args, k) not in (None, False)]
        if args.precision is not None:
            given.append(f"--{args.precision}")
        if given:
            parser.error(f"{' '.join(given)} cannot be combined with --plan (the plan sets them); "
                         f"drop {'it' if len(given) == 1 else 'them'} or drop --plan")
    try:
        if args.plan is None:
            check_global_batch_size(args.global_batch_size, field="--global-batch-size")
        model, cluster = load_model(args.model), load_cluster(args.cluster)
        plan = load_any_plan(args.plan) if args.plan else _homogeneous(args, model, cluster)
        if args.attention is not None:
            if isinstance(plan, ShardedPlan):
                parser.error("--attention prices pipeline plans; this plan is a sharded one")
            if plan.attention not in (None, args.attention):
                parser.error(f"--attention {args.attention}: the plan records attention {plan.attention!r} (it runs "
                             "that kernel); drop the flag or re-plan with tools/plan.py --attention")
            plan = dataclasses.replace(plan, attention=args.attention, predicted=None)
        profiles = [load_profile(p) for p in args.profile] or None
        warn_unused_profiles(profiles, model, cluster, prog="predict.py")
        try:
            if isinstance(plan, ShardedPlan):
                validate_sharded_plan(plan, cluster)
                return _print_sharded(predict_sharded(plan, model, cluster, profile=profiles), args.json)
            validate_plan(plan, model, cluster)
            pred, parts = explain(plan, model, cluster, profile=profiles)
        except PlanError as err:  # the plan is wrong for this model or cluster: name its file
            raise err.with_file(args.plan) from None
    except UserError as err:  # bugs are not caught: they surface as tracebacks
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(dict(pred.to_json_dict(), precision=plan.precision,
                              use_distributed_optimizer=plan.use_distributed_optimizer, breakdown_s=parts), indent=2))
        return 0
    print(f"iteration time  {pred.iteration_time_s:.4g} s (pipeline {pred.pipeline_time_s:.4g}, synchronization "
          f"{pred.synchronization_s:.4g}, gradient reduction "
          f"{pred.gradient_reduction_s:.4g}, optimizer {pred.optimizer_s:.4g})")
    print(f"throughput      {pred.tokens_per_s:.4g} tokens/s, {pred.tflops_per_gpu:.4g} TFLOP/s per GPU "
          f"({pred.num_gpus} GPUs)")
    print(f"memory          max {pred.memory_gib_per_rank_max:.2f} GiB per rank, fits: {pred.fits} ({plan.precision}, "
          f"optimizer state {'sharded over the replicas' if plan.use_distributed_optimizer else 'full on every holder'}"
          f", attention {plan.attention or 'fused on GPUs, unfused on CPUs'}"
          f"; pretrain_gpt.py runs what the plan records: runtime/plan_record.py)")
    if plan.expert_parallel != 1 or plan.expert_tensor_parallel is not None:
        print(f"experts         expert_parallel {plan.expert_parallel}: each rank's memory holds its own experts (their "
              "optimizer state unsharded, an upper bound); the all-to-all from a profile's EP entries or the links "
              "(docs/moe.md; bench/moe.py measures both)")
    print("replica stage island        device      TP  layers   fwd_ms    bwd_ms    idle_s    mem_GiB / cap")
    seen = set()
    for ri, r in enumerate(pred.replicas):
        if id(r) in seen:
            continue
        seen.add(id(r))
        for si, s in enumerate(r.stages):
            layers = f"L{s.layers[0]}-{s.layers[1] - 1}"  # inclusive, as plan.py and pretrain_gpt.py print them
            print(f"{ri:<7} {si:<5} {s.island:<13} {s.device_type:<11} {s.tp:<3} {layers:<8} "
                  f"{1e3 * s.forward_s:<9.4g} {1e3 * s.backward_s:<9.4g} {s.idle_s:<9.4g} "
                  f"{s.memory_gib:.2f} / {s.capacity_gib:g}{'' if s.fits else '  DOES NOT FIT'}")
    print(f"where the iteration goes ({plan.precision}; busiest stage of the slowest replica, then the rest):")
    total = sum(parts.values())
    for name, sec in sorted(parts.items(), key=lambda kv: -kv[1]):
        if sec > 0:
            print(f"  {PART_LABELS.get(name, name):52s} {sec:10.4g} s  {100 * sec / total:5.1f}%")
    if args.trace:
        _print_trace(plan, model, cluster, pred)
    if args.phases:
        _print_phases(plan, model, cluster, args.ddp_bucket_size)
    return 0


def _print_phases(plan: Plan, model, cluster, bucket_numel: int | None) -> None:
    """Per distinct stage (its first rank): perf.phase_memory's peak of each phase, plus the fixed
    framework overhead, against the device's memory."""
    from megatron_het.perf.memory import DEFAULT_OVERHEAD_BYTES
    from megatron_het.perf.phase_memory import PHASES, rank_phase_peaks
    from megatron_het.perf.predict import bucket_parameters
    from megatron_het.runtime.holdings import plan_padded_vocab

    bucket = bucket_numel or bucket_parameters(len(plan.replicas))
    vocab = plan_padded_vocab(model, plan)  # what the runtime builds
    gib = 2.0**30
    print(f"allocation peak of each phase, GiB with {DEFAULT_OVERHEAD_BYTES / gib:g} GiB framework overhead "
          f"(perf/phase_memory.py; buckets of {bucket} parameters):")
    print("replica stage rank  " + " ".join(f"{p[:12]:>12}" for p in PHASES) + "   capacity")
    seen = set()
    for ri, r in enumerate(plan.replicas):
        for si, st in enumerate(r.stages):
            key = (st.island, st.tp, st.layers, si == 0, si == len(r.stages) - 1, r.num_micro_batches)
            if key in seen:
                continue
            seen.add(key)
            device = cluster.island(st.island).device
            peaks = rank_phase_peaks(model, plan, st.ranks[0], bucket_numel=bucket, padded_vocab=vocab,
                                     host_is_device=device.is_host, gloo=device.is_host)
            capacity = device.memory_gib * gib
            cells = " ".join(f"{(v + DEFAULT_OVERHEAD_BYTES) / gib:>12.2f}" for v in (peaks[p] for p in PHASES))
            over = [p for p in PHASES if peaks[p] + DEFAULT_OVERHEAD_BYTES > capacity]
            print(f"{ri:<7} {si:<5} {st.ranks[0]:<5} {cells}   {device.memory_gib:g}"
                  + (f"  DOES NOT FIT in: {', '.join(over)}" if over else ""))


def _print_trace(plan: Plan, model, cluster, pred) -> None:
    """Per distinct replica: the simulated grid of the schedule the runtime runs (megatron_het/perf/predict.py
    replica_trace), its time step and bubble."""
    from megatron_het.perf.predict import replica_trace
    from megatron_het.schedule import render_grid

    seen = set()
    for ri, r in enumerate(plan.replicas):
        key = (tuple((s.island, s.tp, s.layers, s.chunk_layers, s.recompute) for s in r.stages), r.num_micro_batches)
        if key in seen:
            continue
        seen.add(key)
        sim = replica_trace(plan, ri, model, cluster, pred)
        v = f", {plan.virtual_pipeline_size} chunks per stage" if plan.virtual_pipeline_size > 1 else ""
        print(f"replica {ri}: schedule {plan.schedule}{v}, {r.num_micro_batches} micro-batches, pipeline "
              f"{sim.iteration_time:.4g} s, bubble {sim.bubble_fraction:.1%}")
        print(render_grid(sim.schedule, sim))


def _print_sharded(pred, as_json: bool) -> int:
    if as_json:
        print(json.dumps(pred.to_json_dict(), indent=2))
        return 0
    print(f"iteration time  {pred.iteration_time_s:.4g} s (compute {pred.compute_s:.4g}, all-gather "
          f"{pred.all_gather_s:.4g}, reduce-scatter {pred.reduce_scatter_s:.4g}, optimizer {pred.optimizer_s:.4g})")
    print(f"throughput      {pred.tokens_per_s:.4g} tokens/s; fits: {pred.fits}")
    for i, r in enumerate(pred.ranks):
        print(f"rank {i}: {json.dumps(r.to_json_dict())}")
    return 0
