"""The body of pretrain_scripts/pretrain_gpt.py: parse, build, train, close.

Launched by torchrun (one process per GPU, or per CPU rank standing in for one). The plan is either
kind: a pipeline Plan runs the pipeline strategy (``runtime/hetero_trainer.py``), a ShardedPlan the
sharded one (``sharding/trainer.py``); both go through the one trainer and Megatron's loop
(``train/loop.py``). Megatron-style log lines come from rank 0; every rank's time split is gathered
for the end-of-run summary. With --tensorboard-dir, rank 0 also writes TensorBoard scalars
(runtime/tensorboard_log.py; pipeline plans). Only user errors (``UserError``) exit with code 2;
anything else is a bug and surfaces as a traceback.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import sys
import time

import torch.distributed as dist

from megatron_het.cluster import ConfigError
from megatron_het.data.tokenizer import SENTENCEPIECE_TYPES
from megatron_het.errors import UserError
from megatron_het.plan import AnyPlan, Plan, ShardedPlan, load_any_plan
from megatron_het.platform import detect_accelerator, detect_optional_accelerators, enable_cpu_backend
from megatron_het.platform.determinism import apply_deterministic_mode
from megatron_het.platform.matmul_precision import apply_fp32_matmul
from megatron_het.runtime.arguments import PretrainArgs, parse_args
from megatron_het.runtime.communicators import gathered_communicators_line
from megatron_het.runtime.device_check import check_rank_devices
from megatron_het.train.loop import PretrainResult, print_rank0, train_loop

log = logging.getLogger("megatron_het")


def apply_overlap_flags(plan: Plan, args: PretrainArgs) -> Plan:
    """--sequence-parallel turns the plan's sequence parallelism on; --tp-comm-overlap the overlap of
    every stage with TP > 1 (a plan may already choose it per stage)."""
    if args.sequence_parallel:
        plan = dataclasses.replace(plan, sequence_parallel=True)
    if args.tp_comm_overlap:
        plan = dataclasses.replace(plan, replicas=tuple(dataclasses.replace(r, stages=tuple(
            dataclasses.replace(s, tp_comm_overlap=s.tp_comm_overlap or s.tp > 1) for s in r.stages))
            for r in plan.replicas))
    return plan


def apply_expert_flags(plan: Plan, args: PretrainArgs) -> Plan:
    """--expert-model-parallel-size / --expert-tensor-parallel-size, where given, set the plan's expert
    grid; a plan file that records another value is refused (as TP/PP flags against a plan file)."""
    changes = {}
    for flag, field, value, unset in (("--expert-model-parallel-size", "expert_parallel", args.expert_model_parallel_size, 1),
                                      ("--expert-tensor-parallel-size", "expert_tensor_parallel",
                                       args.expert_tensor_parallel_size, None)):
        if value == unset:
            continue
        if getattr(plan, field) not in (unset, value):
            raise ConfigError(f"the plan records {field} {getattr(plan, field)}", field=flag, value=value,
                              fix=f"drop {flag} (the plan decides), or pass the plan's {getattr(plan, field)}")
        changes[field] = value
    return dataclasses.replace(plan, **changes) if changes else plan


def auto_expert_parallel(args: PretrainArgs) -> dict[str, int]:
    """The planner's EP for an MoE model under --hetero-plan auto: --expert-model-parallel-size where
    given (> 1), 1 with rank-failure recovery (which cannot keep EP replicas in step), else none: the
    planner searches every EP. Expert-TP is the planner's (each stage's TP): the flag is refused."""
    if not args.model.is_moe:
        return {}
    if args.expert_tensor_parallel_size is not None:
        raise ConfigError("the planner plans expert-TP = each stage's TP", field="--expert-tensor-parallel-size",
                          value=args.expert_tensor_parallel_size,
                          fix="drop it under --hetero-plan auto, or write a plan with it (tools/plan.py, then edit "
                              "expert_tensor_parallel) and pass the file")
    if args.expert_model_parallel_size != 1:
        if args.resilience is not None:  # refused before minutes of search, as resolve_plan refuses a plan file's
            raise ConfigError("rank-failure recovery cannot keep expert-parallel replicas in step yet",
                              field="--expert-model-parallel-size", value=args.expert_model_parallel_size,
                              fix="drop --expert-model-parallel-size (the planner then plans EP 1), or drop "
                                  "--hetero-resilience")
        return {"expert_parallel": args.expert_model_parallel_size}
    return {"expert_parallel": 1} if args.resilience is not None else {}


def resolve_plan(args: PretrainArgs) -> AnyPlan:
    """A plan file of either kind, validated against the model and cluster, or the planner's best plan
    over both modes (pipeline search, uneven sharded data parallelism); without --hetero-plan, the
    layout Megatron's flags describe (``plan/megatron_layout.py``) or, with none given, the planner's."""
    if args.plan_source is None and args.layout is not None:
        from megatron_het.plan.megatron_layout import plan_from_layout_flags

        plan = dataclasses.replace(plan_from_layout_flags(args.model, args.cluster, args.layout,
                                                          micro_batch_size=args.train.micro_batch_size,
                                                          global_batch_size=args.train.global_batch_size),
                                   precision=args.train.precision)
        lay = args.layout
        print_rank0(f"plan: Megatron-LM's layout from the flags (no --hetero-plan): TP {lay.tensor_model_parallel_size}"
                    f" x PP {lay.pipeline_model_parallel_size} x DP {len(plan.replicas)}, stages on islands "
                    + "; ".join(f"replica {r}: {', '.join(s.island for s in rep.stages)}"
                                for r, rep in enumerate(plan.replicas[:2]))
                    + (" ..." if len(plan.replicas) > 2 else ""))
    elif args.plan_source in (None, "auto"):
        if args.plan_source is None:
            print_rank0("plan: no --hetero-plan and no layout flags (--tensor/--pipeline-model-parallel-size): the "
                        "planner chooses, as --hetero-plan auto")
        from megatron_het.perf import load_profile
        from megatron_het.planner.modes import plan_best

        # priced at the precision the flags run (no flag = fp32); with --use-distributed-optimizer only
        # the overlapped forms that keep that optimizer are priced (the other drops it)
        choice = plan_best(args.model, args.cluster, global_batch_size=args.train.global_batch_size,
                           micro_batch_sizes=(args.train.micro_batch_size,),
                           profile=[load_profile(p) for p in args.profile] if args.profile else None,
                           pipeline_options={"top_k": 3, "precision": args.train.precision,
                                             "keep_distributed_optimizer": args.use_distributed_optimizer,
                                             **auto_expert_parallel(args)},
                           sharded_options={"precision": args.train.precision})
        if choice.pipeline_result is not None:
            print_rank0(f"planner: {choice.pipeline_result.explanation}")
        print_rank0(f"planner: {choice.explanation}")
        plan = choice.plan
    else:
        plan = load_any_plan(args.plan_source)
    if isinstance(plan, ShardedPlan):
        if args.sequence_parallel or args.tp_comm_overlap:
            raise ConfigError("the plan is a sharded data-parallel plan (no tensor parallelism)",
                              field="--sequence-parallel / --tp-comm-overlap", value=args.plan_source,
                              fix="drop the flags or use a pipeline/TP plan")
        for flag, given in (("--expert-model-parallel-size", args.expert_model_parallel_size != 1),
                            ("--expert-tensor-parallel-size", args.expert_tensor_parallel_size is not None),
                            ("--log-params-norm", args.train.log_params_norm),
                            ("--log-num-zeros-in-grad", args.train.log_num_zeros_in_grad),
                            ("--decoupled-lr", args.train.decoupled_lr is not None)):
            if given:  # built in the pipeline strategy only
                raise ConfigError("the sharded data-parallel strategy does not support it yet", field=flag,
                                  value=args.plan_source, fix=f"drop {flag}, or use a pipeline/TP plan")
    else:
        plan = apply_overlap_flags(plan, args)
        if args.use_distributed_optimizer:
            plan = dataclasses.replace(plan, use_distributed_optimizer=True)
        plan = apply_expert_flags(plan, args)
        if args.resilience is not None and (plan.expert_parallel != 1 or plan.expert_tensor_parallel is not None):
            # a re-route gives a survivor more micro-batches than its expert-domain peers: their MoE
            # all-to-alls would no longer meet
            raise ConfigError("rank-failure recovery cannot keep expert-parallel replicas in step yet",
                              field="--hetero-resilience", value=True,
                              fix="drop --hetero-resilience, or train with --expert-model-parallel-size 1")
    plan.validate(args.model, args.cluster)
    check_layout_flags(plan, args)
    return plan


def check_layout_flags(plan: AnyPlan, args: PretrainArgs) -> None:
    """Megatron's --tensor/--pipeline-model-parallel-size, when given, must be the plan's layout: a
    plan may mix TP sizes across stages and stage counts across replicas, and a flag naming one size
    for all of them would otherwise be dropped silently."""
    if args.plan_source is None:
        return  # built from the flags, or the planner's choice with none given
    if args.plan_source == "auto" and (args.tensor_model_parallel_size or args.pipeline_model_parallel_size):
        raise ConfigError("--hetero-plan auto chooses the layout", field="--tensor-model-parallel-size / "
                          "--pipeline-model-parallel-size", value=(args.tensor_model_parallel_size,
                                                                   args.pipeline_model_parallel_size),
                          fix="drop the flags, or write a plan with that layout (tools/plan.py) and pass it")
    if isinstance(plan, ShardedPlan):
        tps, pps = {1}, {1}
    else:
        tps = {s.tp for r in plan.replicas for s in r.stages}
        pps = {len(r.stages) for r in plan.replicas}
    for flag, value, found in (("--tensor-model-parallel-size", args.tensor_model_parallel_size, tps),
                               ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size, pps)):
        if value is not None and found != {value}:
            raise ConfigError(f"the plan {args.plan_source} has {'TP' if 'tensor' in flag else 'stage counts'} "
                              f"{sorted(found)}", field=flag, value=value,
                              fix=f"drop {flag} (the plan decides), or pass {sorted(found)[0]} if that is the only "
                                  "one")


def batch_fns(args: PretrainArgs, *, resume: tuple[int, int] = (0, 0)):
    """(training batch_fn, validation batch_fn or None) of the run's data; ``resume``: the checkpoint's
    (iteration, consumed samples) a resumed run continues from, which sizes the train split so that a
    changed global batch size still has its samples (``GptDataConfig.resume_consumed_samples``)."""
    model = args.model
    from megatron_het.data import GptDataConfig, build_gpt_datasets, gpt_batch_fn
    from megatron_het.data.tokenizer import build_gpt_tokenizer
    from megatron_het.runtime.arguments import tokenizer_spec

    data = args.data
    tokenizer = build_gpt_tokenizer(tokenizer_spec(data, model_vocab_size=model.vocab_size))
    cfg = GptDataConfig(data_path=tuple(data.data_path), split=data.split, seq_length=model.seq_length,
                        seed=args.train.seed, global_batch_size=args.train.global_batch_size,
                        train_iters=args.train.train_iters, eval_iters=args.loop.eval_iters,
                        eval_interval=args.loop.eval_interval or args.train.train_iters,
                        data_cache_path=data.data_cache_path, resume_iteration=resume[0],
                        resume_consumed_samples=resume[1], mock=data.mock_data)
    datasets = build_gpt_datasets(cfg, tokenizer)
    valid = gpt_batch_fn(datasets.valid) if datasets.valid is not None else None
    return gpt_batch_fn(datasets.train), valid


def main(argv: list[str] | None = None) -> int:
    started_at = time.perf_counter()  # --exit-duration-in-mins counts from here, as Megatron-LM's start time
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("megatron_het").setLevel(logging.INFO)
    try:  # bad arguments and plan files fail here, before any rendezvous
        args = parse_args(argv)
        plan = resolve_plan(args)
        if args.train.deterministic_mode:  # the libraries read their settings when they start: before them
            apply_deterministic_mode(tp_comm_overlap=args.tp_comm_overlap)
    except UserError as e:
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 2

    acc = detect_accelerator()
    owned = not dist.is_initialized()  # run_local (tests) sets the group up itself
    if owned:
        from megatron_het.launch.torchrun import launcher_error, missing_rendezvous

        missing = missing_rendezvous()
        if missing:  # plain python: one line on how to launch instead of torch's rendezvous traceback
            print(f"pretrain_gpt.py: error: {launcher_error(plan.world_size, missing)}", file=sys.stderr)
            return 2
        acc.set_device()  # before any group: NCCL binds its communicators to the current device
        minutes = (args.resilience.failure_timeout_s / 60 if args.resilience is not None
                   else args.train.distributed_timeout_minutes)  # resilience: a dead peer fails calls that soon
        dist.init_process_group(acc.world_backend, timeout=datetime.timedelta(minutes=minutes))
    try:
        run(args, acc, plan=plan, started_at=started_at)
        return 0
    except UserError as e:
        print(f"[rank {dist.get_rank()}] pretrain_gpt.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        from megatron_het.resilience.recovery import RankRetired

        if not isinstance(e, RankRetired):
            raise
        print(f"pretrain_gpt.py: {e} (--hetero-resilience: the others continue)", file=sys.stderr, flush=True)
        return 0
    finally:
        if owned and dist.is_initialized():  # a retired rank has left every group already
            dist.destroy_process_group()


def run(args: PretrainArgs, acc, *, plan: AnyPlan | None = None,
        memory_budget_bytes=None, started_at: float | None = None) -> PretrainResult:
    """Build and train the run ``args`` describes on the initialised default group (collective).

    ``plan`` replaces --hetero-plan (tests); ``memory_budget_bytes`` (one per rank, sharded plans)
    emulates device capacity on CPU (``sharding.budget``); ``started_at``: the process's start
    (``time.perf_counter()``), from which --exit-duration-in-mins counts (None: the loop's start).
    """
    for note in args.notes:  # Megatron flags announced as ignored, defaults taken from the plan
        print_rank0(note)
    if not acc.is_gpu:
        print_rank0(enable_cpu_backend().describe())
    print_rank0(f"accelerator: {acc.kind} ({acc.device_name}, tensors on {acc.device}, island backend "
                f"{acc.torch_backend}); {detect_optional_accelerators(acc).describe()}")
    if plan is None:
        plan = resolve_plan(args)
    from megatron_het.runtime.plan_record import reconcile_plan, reconcile_precision

    if not isinstance(plan, ShardedPlan):  # the plan is the one record of precision and optimizer sharding
        plan, reconciled = reconcile_plan(plan, args.train, use_distributed_optimizer=args.use_distributed_optimizer)
    else:  # a sharded plan records its precision (unless written before the field) and nothing else
        reconciled = reconcile_precision(plan.precision, args.train)
    args = dataclasses.replace(args, train=reconciled)
    # an emulation: block declares CPU stand-ins, unless --no-emulation says the islands are real
    check_rank_devices(args.cluster, plan, acc,
                       stand_in=(args.cluster.emulated and not args.no_emulation) or args.device_stand_in)
    print_rank0(apply_fp32_matmul(plan.precision, is_gpu=acc.is_gpu))
    if args.train.deterministic_mode:  # main() applied it before the rendezvous; tests call run() directly
        print_rank0(apply_deterministic_mode(tp_comm_overlap=args.tp_comm_overlap))
    train = args.train
    if train.precision != "fp32":
        scaling = ("" if not train.fp16 else f"; loss scale {train.loss_scale}" if train.loss_scale is not None
                   else f"; dynamic loss scale from {train.initial_loss_scale:g}")
        print_rank0(f"precision: {train.precision} parameters and activations (megatron-core Float16Module), fp32 "
                    f"main parameters and fp32 gradient accumulation/reduction{scaling}")
    plan.validate(args.model, args.cluster)
    check_world_size(plan.world_size)
    cluster = args.cluster
    sharded = isinstance(plan, ShardedPlan)
    for line in plan.describe():
        print_rank0(line)
    if sharded and (len({r.micro_batch_size for r in plan.ranks}) > 1
                    or plan.ranks[0].micro_batch_size != args.train.micro_batch_size):
        print_rank0(f"note: --micro-batch-size {args.train.micro_batch_size} is ignored: each rank uses its plan's "
                    "micro-batch size")
    if not sharded and plan.use_distributed_optimizer:
        print_rank0("optimizer: distributed (fp32 main parameters and Adam moments sharded over every holder of "
                    "each parameter, in proportion to free memory; the plan's memory prediction counts the same)")
    emulate = announce_emulation(cluster, no_emulation=args.no_emulation)
    print_rank0(args.resilience.describe() if args.resilience is not None else "resilience: off (a failed rank ends "
                "the run; --hetero-resilience survives it in-process)")
    if args.resilience is not None and sharded:
        raise ConfigError("in-process fault tolerance re-routes pipeline stages; a sharded plan has none",
                          field="--hetero-resilience", value=args.plan_source, fix="use a pipeline plan or drop the flag")
    print_rank0(communication_line(plan, cluster))
    if sharded and args.tensorboard is not None:
        print_rank0("note: --tensorboard-dir is not written for sharded plans yet (log lines only)")
    load_path, common = checkpoint_to_load(args)
    padded_vocab = common.get("padded_vocab") if common is not None else None
    # --finetune reads the data from its start (Megatron-LM: iteration and consumed samples reset)
    batch_fn, valid_fn = batch_fns(args, resume=resume_position(None if args.loop.finetune else common,
                                                                args.train.global_batch_size))
    tensorboard = resilience = None
    try:
        if sharded:
            from megatron_het.sharding.trainer import ShardedTrainer

            trainer = ShardedTrainer(model=args.model, plan=plan, train=args.train, batch_fn=batch_fn,
                                     cluster=cluster, padded_vocab=padded_vocab, slowdown=None if emulate else 1.0,
                                     memory_budget_bytes=memory_budget_bytes, accelerator=acc)
        else:
            from megatron_het.runtime.hetero_trainer import HeteroTrainer
            from megatron_het.runtime.tensorboard_log import TensorBoardHooks

            if args.tensorboard is not None:
                run_config = {k: dataclasses.asdict(getattr(args, k)) for k in ("model", "train", "data", "loop")}
                tensorboard = TensorBoardHooks(args.tensorboard, group=None,
                                               global_batch_size=args.train.global_batch_size,
                                               seq_length=args.model.seq_length, writer_rank=0,
                                               run_config={**run_config, "plan": args.plan_source})
                print_rank0(f"tensorboard: rank 0 writes to {args.tensorboard.log_dir}"
                            + (f"; W&B project {args.tensorboard.wandb_project}, run {args.tensorboard.wandb_exp_name}"
                               if args.tensorboard.wandb_project else ""))
            from megatron_het.runtime.memory_report import MemoryProbe
            from megatron_het.train.trainer import ChainedHooks

            probe = MemoryProbe()  # what each rank holds, beside the memory model's prediction (end of run)
            train = args.train
            hooks: list = [h for h in (tensorboard, probe) if h is not None]
            if args.resilience is not None:
                from megatron_het.resilience.worker import pretrain_hooks

                train, resilience = pretrain_hooks(args.resilience, model=args.model, plan=plan, train=train,
                                                   batch_fn=batch_fn, padded_vocab=padded_vocab,
                                                   checkpoint_dir=args.loop.save,
                                                   staggered_step=args.staggered_step, cluster=cluster)
                hooks.append(resilience)
            trainer = HeteroTrainer(model=args.model, plan=plan, train=train, batch_fn=batch_fn,
                                    cluster=cluster, padded_vocab=padded_vocab,
                                    slowdown=None if emulate else 1.0, hooks=ChainedHooks(*hooks), accelerator=acc)
            if args.staggered_step:
                trainer.strategy.staggered_step = True
                print_rank0("optimizer: staggered step (each stage steps right after its own gradient reduction)")
        print_rank0(gathered_communicators_line())
        if load_path and args.loop.finetune:
            trained = trainer.load_weights(load_path)
            print_rank0(f"loaded the weights of {load_path} (iteration {trained}) to fine-tune from iteration 0 "
                        "(--finetune: no optimizer state, the data from its start)")
        elif load_path:
            start = trainer.load_checkpoint(load_path, with_optimizer=not args.loop.no_load_optim)
            print_rank0(f"loaded checkpoint {load_path} (iteration {start}, written under another plan is fine)"
                        + ("; optimizer state not loaded (--no-load-optim)" if args.loop.no_load_optim else ""))
        result = train_loop(trainer, loop=args.loop, seq_length=args.model.seq_length, valid_fn=valid_fn,
                            started_at=started_at,
                            on_validation=tensorboard.log_validation if tensorboard is not None else None,
                            tokenizer_model=None if args.data.mock_data or args.data.tokenizer_type not in
                            SENTENCEPIECE_TYPES else args.data.tokenizer_model)  # conversions read SentencePiece
        if not sharded and trainer.iteration > 0:
            from megatron_het.runtime.memory_report import gathered_report_lines

            for line in gathered_report_lines(probe, args.model, plan):
                print_rank0(line)
        return result
    finally:  # the event file is complete even when training fails
        if tensorboard is not None:
            tensorboard.close()
        if resilience is not None:
            resilience.close()


def communication_line(plan: AnyPlan, cluster) -> str:
    """Which communicators the plan's groups use."""
    if isinstance(plan, ShardedPlan):
        return "communication: one data-parallel group over all ranks (uneven all-gather / reduce-scatter)"
    libraries = sorted({cluster.island(s.island).device.collective_library
                        for r in plan.replicas for s in r.stages})
    if len(libraries) > 1:
        from megatron_het.comm import het_backend_info

        info = het_backend_info()
        return (f"communication: the plan spans collective libraries {libraries}; groups across them use the "
                f"het bridge ({info.implementation}: {info.reason}), others the native backend")
    return f"communication: one collective library ({libraries[0]}): native groups only"


def check_world_size(ranks: int) -> None:
    world = dist.get_world_size()
    if world != ranks:
        raise ConfigError(f"the plan uses {ranks} ranks, torchrun started {world}", field="world size", value=world,
                          fix=f"launch with --nproc-per-node/--nnodes giving {ranks} processes")


def announce_emulation(cluster, *, no_emulation: bool) -> bool:
    """Whether slower islands are emulated in this run (said in the log when they are)."""
    emulate = cluster.emulated and not no_emulation
    if emulate:
        factors = ", ".join(f"{i.name} x{cluster.slowdown(i.name):.2f}"
                            + (" (thread CPU time)" if cluster.emulation_clock(i.name) == "thread" else "")
                            for i in cluster.islands)
        print_rank0(f"EMULATION (CPU): slower device types are emulated by waiting (slowdown-1) x the measured "
                    f"compute time after each forward/backward: {factors}")
    return emulate


def resume_position(common: dict | None, global_batch_size: int) -> tuple[int, int]:
    """(iteration, consumed samples) recorded in the common state of the checkpoint a run resumes from
    (``checkpoint_to_load``'s), read as the trainer reads it (train.data_position.position_from_checkpoint);
    (0, 0) for a fresh run."""
    if common is None:
        return 0, 0
    from megatron_het.train.data_position import position_from_checkpoint

    position = position_from_checkpoint(common, global_batch_size)
    return position.iteration, position.consumed_samples


def checkpoint_to_load(args: PretrainArgs) -> tuple[str | None, dict | None]:
    """(--load's latest iteration directory, its verified common state: padded vocabulary, iteration,
    consumed samples), or (None, None) to start fresh."""
    from megatron_het.checkpoint.dist_ckpt import iteration_dir, latest_iteration, read_common

    if not args.loop.load:
        return None, None
    it = latest_iteration(args.loop.load)
    if it is None:
        print_rank0(f"no checkpoint in {args.loop.load}: starting from scratch")
        return None, None
    load_path = iteration_dir(args.loop.load, it)
    return load_path, read_common(load_path)
