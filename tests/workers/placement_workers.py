"""Rank function of the placement test (module-level so spawn can import it; no tests here)."""

from __future__ import annotations

from megatron_het.cluster import ModelSpec
from megatron_het.train.config import TrainConfig

from workers.megatron_workers import batch_fn


def placement_accelerator():
    """A CPU accelerator whose device object is not the default device: ``cpu:0``, not ``cpu``."""
    import torch

    from megatron_het.platform import Accelerator

    return Accelerator(kind="cpu", device_count=0, torch_backend="gloo", device_name="placement-test",
                       device=torch.device("cpu", 0))


def placement_worker(rank, world_size, model: ModelSpec, train: TrainConfig, cases):
    """For each (name, plan, cluster dict | None): build the trainer and run one step inside the
    trap; returns {name: (violations, scoped factory calls seen, group backends, loss)}."""
    import torch.distributed as dist

    from megatron_het.cluster import cluster_from_dict
    from megatron_het.plan import ShardedPlan
    from megatron_het.platform import enable_cpu_backend

    from support.placement import PlacementTrap

    enable_cpu_backend()
    acc = placement_accelerator()
    out = {}
    for name, plan, cluster in cases:
        dist.barrier()
        cluster = cluster_from_dict(cluster) if cluster is not None else None
        with PlacementTrap(acc) as trap:
            if isinstance(plan, ShardedPlan):
                from megatron_het.sharding.trainer import ShardedTrainer

                trainer = ShardedTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed),
                                         cluster=cluster, accelerator=acc)
            else:
                from megatron_het.runtime.hetero_trainer import HeteroTrainer

                trainer = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed),
                                        cluster=cluster, accelerator=acc)
            log = trainer.train_step()
        out[name] = (trap.violations, trap.factory_calls, trap.groups, log.lm_loss)
    return out
