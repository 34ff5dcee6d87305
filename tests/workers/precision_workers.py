"""Rank functions of the mixed-precision tests (module-level so spawn can import them; no tests here)."""

from __future__ import annotations

from megatron_het.cluster import ModelSpec

from workers.megatron_workers import batch_fn, captured_log, comm_report


def precision_cases_worker(rank, world_size, model: ModelSpec, cases, init_full_state, padded_vocab):
    """cases: [(name, plan, train, cluster dict | None)] run one after another in one spawn; returns
    {name: (RunResult, gradient routes, communication report, buckets launched from the last backward's
    hooks (None without --overlap-grad-reduce))}."""
    import torch.distributed as dist

    from megatron_het.cluster import cluster_from_dict
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer
    from megatron_het.sharding import ShardedPlan
    from megatron_het.sharding.trainer import ShardedTrainer

    enable_cpu_backend()
    out = {}
    for name, plan, train, cluster in cases:
        dist.barrier()
        if rank >= plan.world_size:  # smaller plans leave ranks idle (every group is collective: skip all)
            raise ValueError("precision cases must use the whole world")
        if isinstance(plan, ShardedPlan):  # the sharded strategy: routes of its state's collectives only
            trainer = ShardedTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed),
                                     init_full_state=init_full_state, padded_vocab=padded_vocab,
                                     cluster=cluster_from_dict(cluster) if cluster is not None else None)
            res = trainer.run(return_shards=True)
            out[name] = (res, tuple(trainer.strategy.optimizer.routes), None, None)
            continue
        with captured_log("megatron_het.runtime.hetero_trainer") as lines:
            trainer = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed),
                                    init_full_state=init_full_state, padded_vocab=padded_vocab,
                                    cluster=cluster_from_dict(cluster) if cluster is not None else None)
        res = trainer.run(return_shards=True)
        launched = getattr(trainer.strategy.sync, "launched_in_backward", None)  # overlapped buckets, last step
        out[name] = (res, tuple(trainer.strategy.sync.routes), comm_report(trainer.strategy, lines), launched)
    return out
