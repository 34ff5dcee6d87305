"""pretrain_gpt.py's training loop for a ShardedPlan (uneven sharded data parallelism).

``runtime/pretrain.py`` parses the arguments, sets up the process group and resolves the plan;
when the plan is a ShardedPlan it hands over here. Same log lines (Megatron's iteration line,
validation line, checkpoint lines), same data (``_batch_fns``), same checkpoint directory
layout (``--save``/``--load``: ``iter_XXXXXXX`` + tracker, loadable under any plan), and a
per-rank summary of where the time went (compute, emulated slowdown, collectives, optimizer).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_het.cluster import ClusterSpec, ModelSpec
from megatron_het.sharding.plan import ShardedPlan, describe_sharded_plan, validate_sharded_plan
from megatron_het.sharding.trainer import ShardedIterationLog, ShardedTrainer

__all__ = ["iteration_line", "run_sharded_pretrain"]


def iteration_line(*, iteration: int, train_iters: int, global_batch_size: int, elapsed_s: float, lr: float,
                   lm_loss: float, grad_norm: float, tokens_per_iteration: int) -> str:
    """Megatron's per-iteration log line, in the format runtime/pretrain.py prints."""
    return (f" iteration {iteration:8d}/{train_iters:8d} | consumed samples: {iteration * global_batch_size:10d} "
            f"| elapsed time per iteration (ms): {elapsed_s * 1000:.1f} | learning rate: {lr:.3E} "
            f"| global batch size: {global_batch_size:5d} | lm loss: {lm_loss:.6E} "
            f"| grad norm: {grad_norm:.3f} | tokens/s: {tokens_per_iteration / elapsed_s:.0f}")


def _rank_summary(trainer: ShardedTrainer, logs: Sequence[ShardedIterationLog], print_rank0) -> None:
    """Gather every rank's time split; rank 0 prints one line per rank (ms per iteration)."""
    n = len(logs)
    mine = (trainer.rank, trainer.share.island, sum(l.compute_s for l in logs), sum(l.emulated_s for l in logs),
            sum(l.comm_s for l in logs), sum(l.optimizer_s for l in logs), trainer.share.samples)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    print_rank0("per-rank time over the run (comm includes waiting for slower ranks):")
    for rank, island, compute, emulated, comm, opt, samples in gathered:
        print_rank0(f"  rank {rank} ({island}, {samples} samples/it): compute {compute / n * 1000:8.1f} ms/it "
                    f"(emulated {emulated / n * 1000:.1f}), collectives {comm / n * 1000:8.1f} ms/it, "
                    f"optimizer {opt / n * 1000:6.1f} ms/it")


def run_sharded_pretrain(args, *, cluster: ClusterSpec, plan: ShardedPlan, model: ModelSpec,
                         memory_budget_bytes: Sequence[int] | None = None):
    """Train ``plan`` as pretrain_gpt.py's ``run`` does a Plan; returns its PretrainResult. Collective.

    ``args`` is runtime.arguments.PretrainArgs. ``memory_budget_bytes`` (one per rank) emulates
    device capacity on CPU (``sharding.budget``).
    """
    from megatron_het.checkpoint.dist_ckpt import iteration_dir, latest_iteration, read_common
    from megatron_het.runtime.pretrain import PretrainResult, _batch_fns, _evaluate, print_rank0

    world = dist.get_world_size()
    if world != plan.world_size:
        raise ValueError(f"world size: the plan uses {plan.world_size} ranks, torchrun started {world}. "
                         f"Fix: launch with --nproc-per-node/--nnodes giving {plan.world_size} processes")
    validate_sharded_plan(plan, cluster)
    ns, train = args.raw, args.train
    for line in describe_sharded_plan(plan):
        print_rank0(line)
    if len({r.micro_batch_size for r in plan.ranks}) > 1 or plan.ranks[0].micro_batch_size != train.micro_batch_size:
        print_rank0(f"note: --micro-batch-size {train.micro_batch_size} is ignored: each rank uses its plan's "
                    "micro-batch size")
    emulate = cluster.emulated and not ns.no_emulation
    if emulate:
        factors = ", ".join(f"{i.name} x{cluster.slowdown(i.name):.2f}" for i in cluster.islands)
        print_rank0(f"EMULATION (CPU): slower device types are emulated by waiting (slowdown-1) x the measured "
                    f"compute time after each forward/backward: {factors}")
    print_rank0("communication: one data-parallel group over all ranks (uneven all-gather / reduce-scatter)")
    if getattr(args, "tensorboard", None) is not None:
        print_rank0("note: --tensorboard-dir is not written for sharded plans yet (log lines only)")
    batch_fn, valid_fn = _batch_fns(args)
    padded_vocab = load_path = None
    if ns.load:
        it = latest_iteration(ns.load)
        if it is None:
            print_rank0(f"no checkpoint in {ns.load}: starting from scratch")
        else:
            load_path = iteration_dir(ns.load, it)
            padded_vocab = read_common(load_path).get("padded_vocab")
    trainer = ShardedTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn, cluster=cluster,
                             padded_vocab=padded_vocab, slowdown=None if emulate else 1.0,
                             memory_budget_bytes=memory_budget_bytes)
    if load_path:
        start = trainer.load_checkpoint(load_path)
        print_rank0(f"loaded checkpoint {load_path} (iteration {start}, written under another plan is fine)")

    logs, validation = [], []
    tokens = train.global_batch_size * model.seq_length
    window_start = time.perf_counter()
    while trainer.iteration < train.train_iters:
        entry = trainer.train_step()
        logs.append(entry)
        it = trainer.iteration
        if it % train.log_interval == 0:
            elapsed = (time.perf_counter() - window_start) / train.log_interval
            window_start = time.perf_counter()
            print_rank0(iteration_line(iteration=it, train_iters=train.train_iters,
                                       global_batch_size=train.global_batch_size, elapsed_s=elapsed,
                                       lr=train.lr_at(it - 1), lm_loss=entry.lm_loss, grad_norm=entry.grad_norm,
                                       tokens_per_iteration=tokens))
        if ns.eval_interval and ns.eval_iters and valid_fn is not None and it % ns.eval_interval == 0:
            loss = _evaluate(trainer, valid_fn, it, ns.eval_iters)
            validation.append((it, loss))
            print_rank0(f" validation loss at iteration {it} | lm loss value: {loss:.6E} | "
                        f"lm loss PPL: {torch.exp(torch.tensor(loss)).item():.3f}")
        if ns.save and ns.save_interval and it % ns.save_interval == 0 and it < train.train_iters:
            print_rank0(f"saved checkpoint {trainer.save_checkpoint(ns.save)}")
    if ns.save:
        print_rank0(f"saved checkpoint {trainer.save_checkpoint(ns.save)}")
    if logs:
        _rank_summary(trainer, logs, print_rank0)
    return PretrainResult(logs=tuple(logs), validation=tuple(validation))
