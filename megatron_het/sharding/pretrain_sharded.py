"""pretrain_gpt.py's training loop for a ShardedPlan (uneven sharded data parallelism).

``runtime/pretrain.py`` parses the arguments, sets up the process group and resolves the plan;
when the plan is a ShardedPlan it hands over here. Same log lines (Megatron's iteration line,
validation line, checkpoint lines), same data (``_batch_fns``), same checkpoint directory
layout (``--save``/``--load``: ``iter_XXXXXXX`` + tracker, loadable under any plan), and a
per-rank summary of where the time went (compute, emulated slowdown, collectives, optimizer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from megatron_het.cluster import ClusterSpec, ModelSpec
from megatron_het.sharding.plan import ShardedPlan, describe_sharded_plan, validate_sharded_plan
from megatron_het.sharding.trainer import ShardedIterationLog, ShardedTrainer

__all__ = ["run_sharded_pretrain"]


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
    from megatron_het.runtime.pretrain import (
        _batch_fns,
        announce_emulation,
        check_world_size,
        checkpoint_to_load,
        print_rank0,
        train_loop,
    )

    check_world_size(plan.world_size)
    validate_sharded_plan(plan, cluster)
    train = args.train
    for line in describe_sharded_plan(plan):
        print_rank0(line)
    if len({r.micro_batch_size for r in plan.ranks}) > 1 or plan.ranks[0].micro_batch_size != train.micro_batch_size:
        print_rank0(f"note: --micro-batch-size {train.micro_batch_size} is ignored: each rank uses its plan's "
                    "micro-batch size")
    emulate = announce_emulation(cluster, no_emulation=args.raw.no_emulation)
    print_rank0("communication: one data-parallel group over all ranks (uneven all-gather / reduce-scatter)")
    if getattr(args, "tensorboard", None) is not None:
        print_rank0("note: --tensorboard-dir is not written for sharded plans yet (log lines only)")
    batch_fn, valid_fn = _batch_fns(args)
    load_path, padded_vocab = checkpoint_to_load(args)
    trainer = ShardedTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn, cluster=cluster,
                             padded_vocab=padded_vocab, slowdown=None if emulate else 1.0,
                             memory_budget_bytes=memory_budget_bytes)
    if load_path:
        start = trainer.load_checkpoint(load_path)
        print_rank0(f"loaded checkpoint {load_path} (iteration {start}, written under another plan is fine)")
    return train_loop(args, trainer, valid_fn, summary=lambda t, logs: _rank_summary(t, logs, print_rank0))
