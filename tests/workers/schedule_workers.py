"""Rank function of the schedule parity test (#16): each plan trains, saves, resumes, trains on."""

from __future__ import annotations

import os

from megatron_het.cluster import ModelSpec
from megatron_het.train.config import TrainConfig

from workers.megatron_workers import batch_fn


def schedule_cases_worker(rank, world_size, model: ModelSpec, cases, train: TrainConfig, init_full_state,
                          padded_vocab, save_root: str, first_iterations: int):
    """Per case: ``first_iterations`` iterations from ``init_full_state``, a checkpoint, then a new trainer
    loads it and runs to ``train.train_iters``. Returns {name: (logs, shards, what ran)}."""
    from megatron_het.checkpoint.dist_ckpt import iteration_dir
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    enable_cpu_backend()
    out = {}
    for name, plan in cases:
        save = os.path.join(save_root, name)
        first = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed),
                              init_full_state=init_full_state, padded_vocab=padded_vocab)
        head = first.run(first_iterations, return_shards=False)
        first.save_checkpoint(save)
        second = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed),
                               padded_vocab=padded_vocab)
        second.load_checkpoint(iteration_dir(save, first_iterations))
        tail = second.run(train.train_iters - first_iterations, return_shards=True)
        ex = second.strategy.executor
        ran = {"chunks": sorted({a.chunk for a in ex.actions}), "w_actions": sum(a.kind == "W" for a in ex.actions),
               "linears_deferred": second.strategy.wgrad_store.flushed,
               "models": len(second.strategy.gpts), "actions": [str(a) for a in ex.actions],
               "role": (second.strategy.role.replica, second.strategy.role.stage)}
        out[name] = (list(head.iterations) + list(tail.iterations), tail.shards, ran)
    return out
