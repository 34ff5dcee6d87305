"""Rank functions of the mixed-precision tests (module-level so spawn can import them; no tests here)."""

from __future__ import annotations

from megatron_het.cluster import ModelSpec

from workers.megatron_workers import batch_fn, captured_log, comm_report


def precision_cases_worker(rank, world_size, model: ModelSpec, cases, init_full_state, padded_vocab):
    """cases: [(name, plan, train, cluster dict | None)] run one after another in one spawn; returns
    {name: (RunResult, bridged counters or None)}."""
    import torch.distributed as dist

    from megatron_het.cluster import cluster_from_dict
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    enable_cpu_backend()
    out = {}
    for name, plan, train, cluster in cases:
        dist.barrier()
        if rank >= plan.world_size:  # smaller plans leave ranks idle (every group is collective: skip all)
            raise ValueError("precision cases must use the whole world")
        with captured_log("megatron_het.runtime.hetero_trainer") as lines:
            trainer = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed),
                                    init_full_state=init_full_state, padded_vocab=padded_vocab,
                                    cluster=cluster_from_dict(cluster) if cluster is not None else None)
        res = trainer.run(return_shards=True)
        out[name] = (res, tuple(trainer.strategy.sync.routes), comm_report(trainer.strategy, lines))
    return out
