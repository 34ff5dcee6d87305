"""Rank functions of the distributed-optimizer tests (module-level so spawn can import them)."""

from __future__ import annotations

from megatron_het.cluster import ModelSpec
from megatron_het.train.config import TrainConfig

from workers.megatron_workers import batch_fn


def dist_opt_cases_worker(rank, world_size, model: ModelSpec, cases, train: TrainConfig, init_full_state=None,
                          padded_vocab=None):
    """cases: [(name, plan, cluster dict | None, TrainConfig overrides | None)]: (RunResult, MemoryReport)
    per case."""
    import dataclasses

    import torch.distributed as dist

    from megatron_het.cluster import cluster_from_dict
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer
    from megatron_het.runtime.memory_report import MemoryProbe

    enable_cpu_backend()
    out = {}
    for name, plan, cluster, overrides in cases:
        dist.barrier()
        probe = MemoryProbe()
        trainer = HeteroTrainer(model=model, plan=plan, train=dataclasses.replace(train, **(overrides or {})), batch_fn=batch_fn(model, train.seed),
                                init_full_state=init_full_state, padded_vocab=padded_vocab, hooks=probe,
                                cluster=cluster_from_dict(cluster) if cluster else None)
        res = trainer.run(return_shards=True)
        out[name] = (res, probe.report())
    return out


def dist_opt_checkpoint_worker(rank, world_size, model: ModelSpec, steps, train: TrainConfig, init_full_state,
                               padded_vocab, save_dir):
    """steps: [(plan, iterations, load_iteration | None, save: bool)]; the plans say whether the
    distributed optimizer is on."""
    from megatron_het.checkpoint.dist_ckpt import iteration_dir
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    enable_cpu_backend()
    out = []
    for plan, iterations, load_iteration, save in steps:
        trainer = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed),
                                init_full_state=init_full_state if load_iteration is None else None,
                                padded_vocab=padded_vocab)
        if load_iteration is not None:
            trainer.load_checkpoint(iteration_dir(save_dir, load_iteration))
        res = trainer.run(iterations, return_shards=False)
        if save:
            trainer.save_checkpoint(save_dir)
        out.append([log.lm_loss for log in res.iterations])
    return out


def _state_digest(strategy) -> str:
    """sha256 of a stage's parameters and optimizer state (the distributed optimizer's shards, or
    torch's per-parameter state), in a fixed order."""
    import hashlib

    import torch

    h = hashlib.sha256()

    def add(t):
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())

    for name in sorted(strategy.params):
        add(strategy.params[name].float())
    adam = getattr(strategy.sync, "adam", None)
    if adam is not None:
        for t in (adam.master, adam.exp_avg, adam.exp_avg_sq):
            add(t)
    else:
        for name, p in sorted(strategy.opt_params.items()):
            add(p.float())
            for key in ("exp_avg", "exp_avg_sq"):
                add(strategy.optimizer.state[p][key])
    return h.hexdigest()


def phase_bytes_worker(rank, world_size, model: ModelSpec, plan, train: TrainConfig, save_dir: str, padded_vocab=None,
                       budget: int | None = None):
    """Trains ``plan`` for ``train.train_iters``, saves and loads (``budget``: a streamed load's
    bytes per read, None: the default), all under the allocation timeline: ({phase: (start bytes, peak
    bytes, bytes one range added)}, this rank's parameter elements, digest of the state before the
    save, digest after the load)."""
    import torch

    import megatron_het.checkpoint.dist_ckpt as dist_ckpt
    import megatron_het.utils.read_budget as read_budget
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.platform.allocation_peak import allocation_timeline
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    enable_cpu_backend()
    if budget is not None:
        read_budget.READ_GROUP_BYTES = budget
    with allocation_timeline(torch.device("cpu")) as timeline:
        trainer = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed),
                                padded_vocab=padded_vocab)
        trainer.run()
        before = _state_digest(trainer.strategy)
        trainer.strategy.save_checkpoint(save_dir, train.train_iters)
        trainer.strategy.load_checkpoint(dist_ckpt.iteration_dir(save_dir, train.train_iters))
    params = sum(p.numel() for p in trainer.strategy.params.values())
    return ({k: (v.start_bytes, v.peak_bytes, v.added_bytes) for k, v in timeline.phases.items()}, params, before,
            _state_digest(trainer.strategy))
