"""Rank function of tests/multiproc/test_plan_holdings.py (module-level so spawn can import it)."""

from __future__ import annotations

from megatron_het.train.config import TrainConfig


def gathered_holdings_worker(rank, world_size, cases, train: TrainConfig):
    """Per (name, model, plan) case: build the trainer's stage (no step) and return the holdings its
    gradient synchronizer all-gathered from every rank, and this rank's own."""
    import torch.distributed as dist

    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    from workers.megatron_workers import batch_fn

    enable_cpu_backend()
    out = {}
    for name, model, plan in cases:
        dist.barrier()
        stage = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed)).strategy
        out[name] = {"gathered": stage.sync.all_holdings, "own": stage.holdings()}
        stage.close()
    return out
