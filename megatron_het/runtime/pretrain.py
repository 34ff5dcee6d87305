"""The body of pretrain_scripts/pretrain_gpt.py: parse, build, train, close.

Launched by torchrun (one process per GPU, or per CPU rank standing in for one). Megatron-style log
lines come from rank 0; every rank's compute/idle split is gathered for the end-of-run summary.
With --tensorboard-dir, rank 0 also writes TensorBoard scalars (runtime/tensorboard_log.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_het.cluster import ConfigError
from megatron_het.plan import Plan, PlanError, validate_plan
from megatron_het.platform import detect_accelerator, detect_optional_accelerators, enable_cpu_backend
from megatron_het.runtime.arguments import PretrainArgs, parse_args
from megatron_het.sharding.plan import ShardedPlan, load_any_plan, validate_sharded_plan

if TYPE_CHECKING:  # megatron-core loads only after the arguments are checked (fast usage errors)
    from megatron_het.runtime.hetero_trainer import HeteroIterationLog
    from megatron_het.runtime.tensorboard_log import TensorBoardHooks

log = logging.getLogger("megatron_het")


def print_rank0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def _pre_tokenizer_vocab(argv: list[str]) -> int | None:
    """The tokenizer's size, needed before the model is known (Megatron pads from it)."""
    if "--tokenizer-model" not in argv or "--mock-data" in argv:
        return None
    from megatron_het.data import load_tokenizer

    path = argv[argv.index("--tokenizer-model") + 1]
    if not os.path.exists(path):
        raise ConfigError("tokenizer model not found", field="--tokenizer-model", value=path,
                          fix="train one with tools/train_tokenizer.py")
    return int(load_tokenizer(path).vocab_size)


def apply_overlap_flags(plan: Plan, ns) -> Plan:
    """--sequence-parallel turns the plan's sequence parallelism on; --tp-comm-overlap the overlap of
    every stage with TP > 1 (a plan may already choose it per stage)."""
    if ns.sequence_parallel:
        plan = dataclasses.replace(plan, sequence_parallel=True)
    if ns.tp_comm_overlap:
        plan = dataclasses.replace(plan, replicas=tuple(dataclasses.replace(r, stages=tuple(
            dataclasses.replace(s, tp_comm_overlap=s.tp_comm_overlap or s.tp > 1) for s in r.stages))
            for r in plan.replicas))
    return plan


def resolve_plan(args: PretrainArgs) -> Plan | ShardedPlan:
    """A plan file of either kind, validated against the model and cluster, or the planner's best plan
    over both modes (pipeline search, uneven sharded data parallelism)."""
    if args.plan_source == "auto":
        from megatron_het.planner.modes import plan_best

        choice = plan_best(args.model, args.cluster, global_batch_size=args.train.global_batch_size,
                           micro_batch_sizes=(args.train.micro_batch_size,),
                           profile=_load_profile(args.raw.hetero_profile), pipeline_options={"top_k": 3})
        if choice.pipeline_result is not None:
            print_rank0(f"planner: {choice.pipeline_result.explanation}")
        print_rank0(f"planner: {choice.explanation}")
        plan = choice.plan
    else:
        plan = load_any_plan(args.plan_source)
    if isinstance(plan, ShardedPlan):
        if args.raw.sequence_parallel or args.raw.tp_comm_overlap:
            raise ValueError("--sequence-parallel / --tp-comm-overlap: the plan is a sharded data-parallel plan "
                             "(no tensor parallelism). Fix: drop the flags or use a pipeline/TP plan")
        validate_sharded_plan(plan, args.cluster)
    else:
        plan = apply_overlap_flags(plan, args.raw)
        validate_plan(plan, args.model, args.cluster)
    return plan


def _load_profile(path: str | None):
    if not path:
        return None
    from megatron_het.perf import load_profile

    return load_profile(path)


def _batch_fns(args: PretrainArgs):
    ns, model = args.raw, args.model
    if ns.mock_data:
        from functools import partial


        fn = partial(_mock_batch, model.seq_length, model.vocab_size, args.train.seed)
        return fn, partial(_mock_batch, model.seq_length, model.vocab_size, args.train.seed + 1)
    from megatron_het.data import GptDataConfig, build_gpt_datasets, gpt_batch_fn, load_tokenizer

    tokenizer = load_tokenizer(ns.tokenizer_model, tokenizer_type=ns.tokenizer_type)
    cfg = GptDataConfig(data_path=tuple(ns.data_path), split=ns.split, seq_length=model.seq_length,
                        seed=args.train.seed, global_batch_size=args.train.global_batch_size,
                        train_iters=args.train.train_iters, eval_iters=ns.eval_iters,
                        eval_interval=ns.eval_interval or args.train.train_iters,
                        data_cache_path=ns.data_cache_path)
    datasets = build_gpt_datasets(cfg, tokenizer)
    valid = gpt_batch_fn(datasets.valid) if datasets.valid is not None else None
    return gpt_batch_fn(datasets.train), valid


def _mock_batch(seq_length, vocab_size, seed, iteration, indices):
    from megatron_het.data.synthetic import synthetic_batch

    return synthetic_batch(seed=seed, iteration=iteration, indices=indices, seq_length=seq_length,
                           vocab_size=vocab_size)


def describe_plan_lines(plan: Plan) -> list[str]:
    lines = [f"plan: {len(plan.replicas)} replica(s), {plan.world_size} ranks, micro-batch {plan.micro_batch_size}, "
             f"global batch {plan.global_batch_size}, schedule {plan.schedule}"]
    for r, replica in enumerate(plan.replicas):
        stages = " | ".join(f"{s.island}({s.device_type}) TP={s.tp} ranks {s.ranks[0]}-{s.ranks[-1]} "
                            f"layers {s.layers[0]}-{s.layers[1] - 1}" for s in replica.stages)
        lines.append(f"  replica {r}: {replica.num_micro_batches} micro-batches: {stages}")
    if plan.predicted:
        p = plan.predicted
        lines.append(f"  predicted: {p.get('iteration_time_s', float('nan')) * 1000:.1f} ms/iteration, "
                     f"{p.get('tokens_per_s', float('nan')):.0f} tokens/s")
    return lines


@dataclass(frozen=True, kw_only=True)
class PretrainResult:
    """What one rank saw of a run (losses are global: every rank holds the same values)."""

    logs: tuple[HeteroIterationLog, ...]  # one per iteration trained in this run
    validation: tuple[tuple[int, float], ...]  # (iteration, validation loss) at each --eval-interval


def _stage_summary(trainer, logs) -> None:
    """Gather every rank's compute/idle; rank 0 prints one line per stage (mean over its ranks)."""
    from megatron_het.runtime.tensorboard_log import gather_stage_times

    stages = gather_stage_times(trainer.role, logs, group=None, dst=0)
    if stages is None:
        return
    print("per-stage time over the run (mean over the stage's ranks):")
    for st in stages:
        n = st.iterations
        print(f"  replica {st.replica} stage {st.stage} ({st.island}): compute {st.compute_s / n * 1000:8.1f} ms/it, "
              f"idle {st.idle_s / n * 1000:8.1f} ms/it ({100 * st.idle_s / max(st.compute_s + st.idle_s, 1e-9):4.1f}% "
              f"idle), peak memory {st.peak_memory_bytes / 2**20:.0f} MiB")


def _evaluate(trainer, valid_fn, iteration: int, eval_iters: int) -> float:
    losses = [trainer.evaluate(valid_fn, it) for it in range(eval_iters)]
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("megatron_het").setLevel(logging.INFO)
    try:
        args = parse_args(argv, tokenizer_vocab=_pre_tokenizer_vocab(argv))
    except ConfigError as e:
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 2

    acc = detect_accelerator()
    owned = not dist.is_initialized()  # run_local (tests) sets the group up itself
    if owned:
        dist.init_process_group("gloo" if not acc.is_gpu else "cpu:gloo,cuda:nccl",
                                timeout=datetime.timedelta(minutes=10))
    try:
        run(args, acc)
        return 0
    except (ConfigError, PlanError, ValueError) as e:
        print(f"[rank {dist.get_rank()}] pretrain_gpt.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if owned:
            dist.destroy_process_group()


def run(args: PretrainArgs, acc) -> PretrainResult:
    """Build and train the run ``args`` describes on the initialised default group (collective)."""
    from megatron_het.runtime.hetero_trainer import HeteroTrainer
    from megatron_het.runtime.tensorboard_log import TensorBoardHooks

    if not acc.is_gpu:
        print_rank0(enable_cpu_backend().describe())
    print_rank0(f"accelerator: {acc.kind} ({acc.device_name}); {detect_optional_accelerators(acc).describe()}")
    if acc.is_gpu:
        raise ValueError("this build's heterogeneous runtime places tensors on the CPU only (got a GPU). "
                         "Fix: run on CPU ranks, or wait for the GPU device placement of the runtime")
    plan = resolve_plan(args)
    if isinstance(plan, ShardedPlan):
        from megatron_het.sharding.pretrain_sharded import run_sharded_pretrain

        return run_sharded_pretrain(args, cluster=args.cluster, plan=plan, model=args.model)
    check_world_size(plan.world_size)
    for line in describe_plan_lines(plan):
        print_rank0(line)
    if plan.use_distributed_optimizer:
        print_rank0("note: plan.use_distributed_optimizer is used by the memory prediction; this runtime keeps "
                    "full optimizer state on every holder of a parameter")
    cluster = args.cluster
    emulate = announce_emulation(cluster, no_emulation=args.raw.no_emulation)

    libraries = sorted({cluster.island(s.island).device.collective_library
                        for r in plan.replicas for s in r.stages})
    if len(libraries) > 1:
        from megatron_het.comm import het_backend_info

        info = het_backend_info()
        print_rank0(f"communication: the plan spans collective libraries {libraries}; groups across them use the "
                    f"het bridge ({info.implementation}: {info.reason}), others the native backend")
    else:
        print_rank0(f"communication: one collective library ({libraries[0]}): native groups only")
    batch_fn, valid_fn = _batch_fns(args)
    load_path, padded_vocab = checkpoint_to_load(args)
    tensorboard = None
    if args.tensorboard is not None:
        tensorboard = TensorBoardHooks(args.tensorboard, group=None, global_batch_size=args.train.global_batch_size,
                                       seq_length=args.model.seq_length, writer_rank=0)
        print_rank0(f"tensorboard: rank 0 writes to {args.tensorboard.log_dir}")
    try:
        trainer = HeteroTrainer(model=args.model, plan=plan, train=args.train, batch_fn=batch_fn,
                                cluster=cluster, padded_vocab=padded_vocab,
                                slowdown=None if emulate else 1.0, hooks=tensorboard)
        if load_path:
            start = trainer.load_checkpoint(load_path)
            print_rank0(f"loaded checkpoint {load_path} (iteration {start}, written under another plan is fine)")
        return train_loop(args, trainer, valid_fn, tensorboard=tensorboard)
    finally:  # the event file is complete even when training fails
        if tensorboard is not None:
            tensorboard.close()


def check_world_size(ranks: int) -> None:
    world = dist.get_world_size()
    if world != ranks:
        raise ValueError(f"world size: the plan uses {ranks} ranks, torchrun started {world}. "
                         f"Fix: launch with --nproc-per-node/--nnodes giving {ranks} processes")


def announce_emulation(cluster, *, no_emulation: bool) -> bool:
    """Whether slower islands are emulated in this run (said in the log when they are)."""
    emulate = cluster.emulated and not no_emulation
    if emulate:
        factors = ", ".join(f"{i.name} x{cluster.slowdown(i.name):.2f}" for i in cluster.islands)
        print_rank0(f"EMULATION (CPU): slower device types are emulated by waiting (slowdown-1) x the measured "
                    f"compute time after each forward/backward: {factors}")
    return emulate


def checkpoint_to_load(args: PretrainArgs) -> tuple[str | None, int | None]:
    """(--load's latest iteration directory, its padded vocabulary), or (None, None) to start fresh."""
    from megatron_het.checkpoint.dist_ckpt import iteration_dir, latest_iteration, read_common

    if not args.raw.load:
        return None, None
    it = latest_iteration(args.raw.load)
    if it is None:
        print_rank0(f"no checkpoint in {args.raw.load}: starting from scratch")
        return None, None
    load_path = iteration_dir(args.raw.load, it)
    return load_path, read_common(load_path).get("padded_vocab")


def train_loop(args: PretrainArgs, trainer, valid_fn, *, tensorboard: TensorBoardHooks | None = None,
               summary=_stage_summary) -> PretrainResult:
    """Megatron's loop for either trainer (HeteroTrainer, ShardedTrainer): log lines, evaluation,
    checkpoints; ``summary(trainer, logs)`` prints where the time went at the end."""
    ns, train = args.raw, args.train
    logs = []
    validation = []
    window_start = time.perf_counter()
    while trainer.iteration < train.train_iters:
        entry = trainer.train_step()
        logs.append(entry)
        it = trainer.iteration
        if it % train.log_interval == 0:
            elapsed = (time.perf_counter() - window_start) / train.log_interval
            window_start = time.perf_counter()
            tokens = train.global_batch_size * args.model.seq_length
            print_rank0(f" iteration {it:8d}/{train.train_iters:8d} | consumed samples: {it * train.global_batch_size:10d} "
                        f"| elapsed time per iteration (ms): {elapsed * 1000:.1f} | learning rate: {train.lr_at(it - 1):.3E} "
                        f"| global batch size: {train.global_batch_size:5d} | lm loss: {entry.lm_loss:.6E} "
                        f"| grad norm: {entry.grad_norm:.3f} | tokens/s: {tokens / elapsed:.0f}")
        if ns.eval_interval and ns.eval_iters and valid_fn is not None and it % ns.eval_interval == 0:
            loss = _evaluate(trainer, valid_fn, it, ns.eval_iters)
            validation.append((it, loss))
            if tensorboard is not None:
                tensorboard.log_validation(it, loss)
            print_rank0(f" validation loss at iteration {it} | lm loss value: {loss:.6E} | "
                        f"lm loss PPL: {torch.exp(torch.tensor(loss)).item():.3f}")
        if ns.save and ns.save_interval and it % ns.save_interval == 0 and it < train.train_iters:
            print_rank0(f"saved checkpoint {trainer.save_checkpoint(ns.save)}")
    if ns.save:
        print_rank0(f"saved checkpoint {trainer.save_checkpoint(ns.save)}")
    if logs:
        summary(trainer, logs)
    return PretrainResult(logs=tuple(logs), validation=tuple(validation))
