"""Rank function of tests/multiproc/test_boundary_groups.py (module-level so spawn can import it)."""

from __future__ import annotations

from megatron_het.train.config import TrainConfig


def boundary_groups_worker(rank, world_size, model, plan, train: TrainConfig):
    """Build the trainer's stage (no step); per neighbour side ("prev"/"next") of this rank's link: name
    and ranks of the boundary's group; then train one step so the transfers run on those groups.
    Returns (sides, loss)."""
    import torch.distributed as dist

    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    from workers.megatron_workers import batch_fn

    enable_cpu_backend()
    trainer = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed))
    link = next(iter(trainer.strategy.executor.links.values()))  # every micro-batch's link is this one

    def describe(group):
        return None if group is None else (group.group_name, tuple(dist.get_process_group_ranks(group)))

    sides = {side: describe(peer.group) for side, peer in (("prev", link.prev), ("next", link.next)) if peer is not None}
    res = trainer.run(1, return_shards=False)
    trainer.strategy.close()
    return sides, [log.lm_loss for log in res.iterations]
