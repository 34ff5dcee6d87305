"""Rank functions for the multi-process tests (module-level so spawn can import them)."""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial

from megatron_het.cluster import ModelSpec
from megatron_het.data.synthetic import synthetic_batch
from megatron_het.model.groups import BlockShape
from megatron_het.train.config import TrainConfig


def batch_fn(model: ModelSpec, seed: int):
    return partial(_batch, model.seq_length, model.vocab_size, seed)


def _batch(seq_length, vocab_size, seed, iteration, indices):
    return synthetic_batch(seed=seed, iteration=iteration, indices=indices, seq_length=seq_length,
                           vocab_size=vocab_size)


def megatron_block_worker(rank, world_size, model: ModelSpec, train: TrainConfig, shape: BlockShape,
                          init_full_state=None, padded_vocab=None, pretrain_argv=None):
    """``pretrain_argv``: read the batches pretrain_gpt.py reads for that command line (its data flags),
    instead of the synthetic ones."""
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.megatron_trainer import train_megatron_block

    enable_cpu_backend()
    if pretrain_argv is not None:
        from megatron_het.cli.pretrain import batch_fns
        from megatron_het.runtime.arguments import parse_args

        batches = batch_fns(parse_args(pretrain_argv))[0]
    else:
        batches = batch_fn(model, train.seed)
    return train_megatron_block(model=model, train=train, shape=shape, batch_fn=batches,
                                init_full_state=init_full_state, return_shards=True,
                                padded_vocab=padded_vocab)


def hetero_worker(rank, world_size, model: ModelSpec, plan, train: TrainConfig, init_full_state=None,
                  padded_vocab=None, cluster=None):
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    enable_cpu_backend()
    trainer = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed),
                            cluster=cluster, init_full_state=init_full_state, padded_vocab=padded_vocab)
    return trainer.run(return_shards=True)


def hetero_cases_worker(rank, world_size, model: ModelSpec, cases, train: TrainConfig, init_full_state=None,
                        padded_vocab=None):
    """Run several plans one after another in one spawn (each spawn pays megatron's import)."""
    import time

    import torch.distributed as dist

    from megatron_het.cluster import cluster_from_dict
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer
    from megatron_het.runtime.megatron_trainer import train_megatron_block

    enable_cpu_backend()
    out = {}
    for name, plan, *rest in cases:  # (name, plan) or (name, plan, cluster as a dict)
        cluster = cluster_from_dict(rest[0]) if rest else None
        start = time.perf_counter()
        dist.barrier()
        if isinstance(plan, BlockShape):
            res = train_megatron_block(model=model, train=train, shape=plan, batch_fn=batch_fn(model, train.seed),
                                       init_full_state=init_full_state, return_shards=True,
                                       padded_vocab=padded_vocab)
        else:
            with captured_log("megatron_het.runtime.hetero_trainer") as lines:
                trainer = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed),
                                        init_full_state=init_full_state, padded_vocab=padded_vocab, cluster=cluster)
            # forward calls of each of the stage's layers: twice per micro-batch where it recomputes
            layers = list(getattr(getattr(trainer.strategy.gpt, "decoder", None), "layers", None) or [])
            calls = [[] for _ in layers]
            hooks = [layer.register_forward_hook(lambda *_, c=c: c.append(1)) for layer, c in zip(layers, calls)]
            res = trainer.run(return_shards=True)
            for hook in hooks:
                hook.remove()
            res = dataclasses.replace(res, routes=tuple(trainer.strategy.sync.routes))
            out[("comm", name)] = comm_report(trainer.strategy, lines)
            out[("first_layer_calls", name)] = len(calls[0]) if calls else 0
            out[("layer_calls", name)] = [len(c) for c in calls]
        out[name] = (res, time.perf_counter() - start)
    return out


def comm_report(strategy, log_lines) -> dict:
    """What a test asserts about communication paths: the start-up log and the bridge counters."""
    return {"log": list(log_lines), "paths": strategy.paths,
            "boundary_bridge_bytes": sum(g.bridge_bytes() for g in strategy.boundary_bridges.values()),
            "gradient_routes": tuple(kind for _, kind in strategy.sync.routes)}


@contextlib.contextmanager
def captured_log(name: str):
    """INFO lines logged under ``name`` while the block runs."""
    import logging

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger, handler = logging.getLogger(name), Collect()
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def checkpoint_worker(rank, world_size, model: ModelSpec, steps, train: TrainConfig, init_full_state,
                      padded_vocab, save_dir):
    """steps: [(plan, iterations, load_iteration | None, save: bool)] run one after another."""

    from megatron_het.checkpoint.dist_ckpt import iteration_dir
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    enable_cpu_backend()
    out = []
    for plan, iterations, load_iteration, save in steps:
        if rank >= plan.world_size:
            raise ValueError("checkpoint_worker needs plans over the whole world")
        trainer = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed),
                                init_full_state=init_full_state if load_iteration is None else None,
                                padded_vocab=padded_vocab)
        if load_iteration is not None:
            trainer.load_checkpoint(iteration_dir(save_dir, load_iteration))
        res = trainer.run(iterations, return_shards=True)
        if save:
            trainer.save_checkpoint(save_dir)
        out.append(res)
    return out


def decoder_outputs_worker(rank, world_size, models, plan, train: TrainConfig):
    """Per model of ``models`` ({name: ModelSpec}): train ``plan`` one iteration and return the decoder's
    output of every forward on this rank (train mode: dropout on)."""
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    enable_cpu_backend()
    out = {}
    for name, model in models.items():
        trainer = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed))
        captured = []
        trainer.strategy.gpt.decoder.register_forward_hook(lambda m, i, o: captured.append(o.detach().clone()))
        trainer.run(return_shards=False)
        trainer.strategy.close()
        out[name] = captured
    return out
