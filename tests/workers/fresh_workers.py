"""Rank functions of the fresh-start tests: pretrain_gpt.py's own ``run`` from no state at all."""

from __future__ import annotations


def fresh_start_worker(rank, world_size, cases, common_argv):
    """For each (name, plan, cluster file, extra flags): the initial shards of a trainer built as
    pretrain_gpt.py builds it (no --load, no supplied state), then a run of pretrain_gpt.py's ``run``
    with the same flags. Returns name -> {"initial": shards (reporting ranks), "losses", "log"}."""
    import contextlib
    import io

    from megatron_het.cli.pretrain import batch_fns, run
    from megatron_het.plan import ShardedPlan
    from megatron_het.platform import detect_accelerator, enable_cpu_backend
    from megatron_het.runtime.arguments import parse_args

    enable_cpu_backend()
    out = {}
    for name, plan, cluster_file, extra in cases:
        argv = [*common_argv, "--hetero-cluster", cluster_file, "--hetero-plan", "unused", *extra]
        args = parse_args(argv)
        train_fn, _ = batch_fns(args)
        if isinstance(plan, ShardedPlan):
            from megatron_het.sharding.trainer import ShardedTrainer as Built
        else:
            from megatron_het.runtime.hetero_trainer import HeteroTrainer as Built
        built_plan, train = (plan, args.train) if isinstance(plan, ShardedPlan) else _reconciled(plan, args)
        trainer = Built(model=args.model, plan=built_plan, train=train, batch_fn=train_fn, cluster=args.cluster,
                        slowdown=1.0)
        initial = trainer.shards() if trainer.strategy.reports_shards else {}
        attention = sorted({type(m).__name__ for gpt in getattr(trainer.strategy, "gpts", ()) for m in gpt.modules()
                            if type(m).__name__ in ("DotProductAttention", "SdpaAttention")})
        trainer.close()
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            result = run(args, detect_accelerator(), plan=plan)
        out[name] = {"initial": initial, "losses": [log.lm_loss for log in result.logs], "log": buf.getvalue(),
                     "attention": attention}
    return out


def _reconciled(plan, args):
    """(plan, train) as pretrain_gpt.py's ``run`` reconciles them (precision, optimizer sharding)."""
    from megatron_het.runtime.plan_record import reconcile_plan

    return reconcile_plan(plan, args.train, use_distributed_optimizer=args.use_distributed_optimizer)


def corrupted_holder_worker(rank, world_size, plan, common_argv, cluster_file):
    """A fresh trainer whose TP rank 1 copies of replicated parameters are zero (what the start-up
    synchronisation before issue #34 left: the owner's values on TP rank 0, zeros on its TP peers),
    then the holders' check: returns the error every rank raised (None if none did)."""
    import torch

    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.arguments import parse_args
    from megatron_het.runtime.consistency import WeightMismatchError
    from megatron_het.runtime.hetero_trainer import HeteroTrainer
    from megatron_het.train.loop import check_weights

    enable_cpu_backend()
    args = parse_args([*common_argv, "--hetero-cluster", cluster_file, "--hetero-plan", "unused"])
    trainer = HeteroTrainer(model=args.model, plan=plan, train=args.train, batch_fn=lambda *_: None, slowdown=1.0)
    check_weights(trainer, "as built")  # a fresh build agrees
    local, params = trainer.strategy.holdings(), trainer.strategy.params
    with torch.no_grad():
        for h in local:
            if h.partition_dim is None and h.tp_rank == 1:
                params[h.name].zero_()
    try:
        check_weights(trainer, "after zeroing")
    except WeightMismatchError as e:
        return str(e)
    finally:
        trainer.close()
    return None


def reference_worker(rank, world_size, argv, padded_vocab):
    """The single-process megatron-core run (TP = PP = DP = 1, no supplied state: the same seeded
    full model) on the batches pretrain_gpt.py reads for ``argv``."""
    from megatron_het.cli.pretrain import batch_fns
    from megatron_het.model.groups import BlockShape
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.arguments import parse_args
    from megatron_het.runtime.megatron_trainer import train_megatron_block

    enable_cpu_backend()
    args = parse_args(argv)
    train_fn, _ = batch_fns(args)
    return train_megatron_block(model=args.model, train=args.train, shape=BlockShape(tp=1, pp=1, dp=1),
                                batch_fn=train_fn, return_shards=True, padded_vocab=padded_vocab)


def device_check_worker(rank, world_size, argv, plan):
    """pretrain_gpt.py's ``run`` on CPU processes: the error each rank raises (None if none did)."""
    from megatron_het.cli.pretrain import run
    from megatron_het.cluster import ConfigError
    from megatron_het.platform import detect_accelerator, enable_cpu_backend
    from megatron_het.runtime.arguments import parse_args

    enable_cpu_backend()
    try:
        run(parse_args(argv), detect_accelerator(), plan=plan)
    except ConfigError as e:
        return str(e)
    return None


def evaluate_twice_worker(rank, world_size, plan, common_argv, cluster_file):
    """A fresh trainer with dropout 0.5 evaluates one validation batch twice and trains one step: the
    two validation losses (equal only if dropout is off while validating) and the step's loss."""
    from megatron_het.cli.pretrain import batch_fns
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.arguments import parse_args
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    enable_cpu_backend()
    args = parse_args([*common_argv, "--hetero-cluster", cluster_file, "--hetero-plan", "unused",
                       "--hidden-dropout", "0.5", "--attention-dropout", "0.5", "--eval-iters", "1"])
    train_fn, valid_fn = batch_fns(args)
    trainer = HeteroTrainer(model=args.model, plan=_reconciled(plan, args)[0], train=args.train, batch_fn=train_fn,
                            slowdown=1.0)
    try:
        first, second = trainer.evaluate(valid_fn, 0), trainer.evaluate(valid_fn, 0)
        training = all(m.training for m in trainer.strategy.modules)
        step = trainer.run(1).iterations[0].lm_loss
    finally:
        trainer.close()
    return first, second, training, step
