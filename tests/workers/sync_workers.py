"""Rank function of the host-sync test (module-level so spawn can import it; no tests here)."""

from __future__ import annotations

import contextlib

from workers.megatron_workers import batch_fn

# Tensor methods that copy a device value to the host and so wait for the device
READS = ("item", "tolist", "__float__", "__int__", "__bool__")


@contextlib.contextmanager
def counting_host_reads(counts: dict[str, int]):
    """Inside: every host read of a tensor value (``READS``) made by megatron_het's code is counted by
    method and call site. Reads inside torch and megatron-core are of host tensors (torch AdamW's
    step counter, kept on the CPU when not capturable; megatron-core's check of the CPU RNG state):
    no wait for the device on a GPU either, so they are not counted."""
    import os
    import traceback

    import torch

    import megatron_het

    package = os.path.dirname(megatron_het.__file__) + os.sep
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name, fn):
        def wrapper(self, *args, **kwargs):
            caller = traceback.extract_stack(limit=2)[0]
            if caller.filename.startswith(package):
                key = f"{name} {os.path.relpath(caller.filename, os.path.dirname(package))}:{caller.lineno}"
                counts[key] = counts.get(key, 0) + 1
            return fn(self, *args, **kwargs)
        return wrapper

    for name, fn in saved.items():
        setattr(torch.Tensor, name, counted(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def host_sync_worker(rank, world_size, model, cases):
    """cases: [(name, plan, train)]; each trainer is built, then ``train.train_iters`` iterations run
    while host reads and world all-reduces are counted. Returns {name: (reads, world reduces, losses)}."""
    import torch.distributed as dist

    import megatron_het.runtime.hetero_trainer as hetero
    import megatron_het.sharding.trainer as sharded
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.sharding import ShardedPlan

    enable_cpu_backend()
    out = {}
    for name, plan, train in cases:
        dist.barrier()
        if isinstance(plan, ShardedPlan):
            module = sharded
            trainer = sharded.ShardedTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed))
        else:
            module = hetero
            trainer = hetero.HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed))
        reduces = []
        world_reduce = module.all_reduce_world

        def counted_reduce(tensor, *args, _reduce=world_reduce, **kwargs):
            reduces.append(tensor.numel())
            return _reduce(tensor, *args, **kwargs)

        module.all_reduce_world = counted_reduce
        try:
            with counting_host_reads({}) as reads:
                logs = trainer.run().iterations
        finally:
            module.all_reduce_world = world_reduce
        out[name] = (dict(reads), len(reduces), [log.lm_loss for log in logs])
    return out
