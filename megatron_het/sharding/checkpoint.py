"""Checkpoints of uneven shards that load into any other shard layout (or any other plan).

Save (collective): the master weights and both Adam moments are all-gathered (uneven) into full
flat vectors, split by global parameter name (``checkpoint/full_state.py`` names), and rank 0
writes one ``torch.save`` file atomically (temporary file + ``os.replace``). The file does not
depend on the flat order or on the fractions, so loading re-slices it for the loader's layout:
every rank reads the file and keeps its own range. ``model`` is a full state dict, so
``HeteroTrainer(init_full_state=...)`` and ``assemble_full_state`` users can read it too.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from megatron_het.sharding.trainer import ShardedTrainer

__all__ = ["SHARDED_CHECKPOINT_FORMAT", "ShardedCheckpointError", "save_sharded", "load_sharded",
           "read_full_state"]

SHARDED_CHECKPOINT_FORMAT = "megatron-het-sharded-checkpoint-v1"  # "format" key of the file


class ShardedCheckpointError(ValueError):
    """A checkpoint that does not fit the trainer loading it."""


def save_sharded(trainer: ShardedTrainer, path: str) -> str:
    """Write ``trainer``'s full state to ``path`` (collective: call on every rank). Returns ``path``."""
    opt = trainer.optimizer
    model = trainer.full_tensors(trainer.gather(opt.master))
    exp_avg = trainer.full_tensors(trainer.gather(opt.exp_avg))
    exp_avg_sq = trainer.full_tensors(trainer.gather(opt.exp_avg_sq))
    if trainer.rank == 0:
        payload: dict[str, Any] = {
            "format": SHARDED_CHECKPOINT_FORMAT, "iteration": trainer.iteration, "step": opt.step_count,
            "padded_vocab": trainer.stage.vocab_size,
            "consumed_samples": trainer.iteration * trainer.train.global_batch_size,
            "plan": trainer.plan.to_dict(), "model": model,
            "optimizer": {n: {"exp_avg": exp_avg[n], "exp_avg_sq": exp_avg_sq[n]} for n in model},
        }
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        torch.save(payload, tmp)
        os.replace(tmp, path)  # readers see the old file or the new one, never a partial one
    dist.barrier()
    return path


def read_full_state(path: str) -> dict[str, Any]:
    """The checkpoint's contents (``model``: name -> full tensor), validated."""
    if not os.path.exists(path):
        raise ShardedCheckpointError(f"path: no checkpoint at {path!r}. Fix: pass a file written by save_sharded")
    data = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(data, dict) or data.get("format") != SHARDED_CHECKPOINT_FORMAT:
        raise ShardedCheckpointError(f"{path}: format: expected {SHARDED_CHECKPOINT_FORMAT!r} (got "
                                     f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}). "
                                     "Fix: pass a file written by save_sharded")
    return data


@torch.no_grad()
def load_sharded(trainer: ShardedTrainer, path: str, *, with_optimizer: bool = True) -> int:
    """Load a checkpoint written under any shard layout into ``trainer``'s; returns its iteration."""
    data = read_full_state(path)
    if data["padded_vocab"] != trainer.stage.vocab_size:
        raise ShardedCheckpointError(
            f"{path}: padded_vocab: the checkpoint has {data['padded_vocab']} embedding rows, this trainer builds "
            f"{trainer.stage.vocab_size}. Fix: construct the trainer with padded_vocab={data['padded_vocab']}")
    names = set(trainer.index.names)
    if set(data["model"]) != names:
        missing, extra = sorted(names - set(data["model"])), sorted(set(data["model"]) - names)
        raise ShardedCheckpointError(f"{path}: model: parameter names differ (missing {missing[:3]}, unexpected "
                                     f"{extra[:3]}). Fix: load a checkpoint of the same model")

    def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        for name in trainer.index.names:
            if tuple(tensors[name].shape) != trainer.shapes[name]:
                raise ShardedCheckpointError(f"{path}: {name}: shape {tuple(tensors[name].shape)} in the file, "
                                             f"{trainer.shapes[name]} in the model. Fix: load a checkpoint of the "
                                             "same model")
        return torch.cat([tensors[n].reshape(-1).float() for n in trainer.index.names])

    start, stop = trainer.layout.range(trainer.rank)
    opt = trainer.optimizer
    opt.master.copy_(flat(data["model"])[start:stop])
    if with_optimizer:
        moments = data["optimizer"]
        opt.exp_avg.copy_(flat({n: moments[n]["exp_avg"] for n in moments})[start:stop])
        opt.exp_avg_sq.copy_(flat({n: moments[n]["exp_avg_sq"] for n in moments})[start:stop])
        opt.step_count = int(data["step"])
    trainer.iteration = int(data["iteration"])
    return trainer.iteration
