"""Checkpoints of uneven shards in the project's one checkpoint format (``checkpoint/dist_ckpt.py``).

Save (collective): the fp32 values and both Adam moments (``optim.DistributedOptimizer.local_state``)
as full tensors named by global parameter name; rank 0 is the main replica of every tensor and writes it
through megatron-core ``dist_checkpointing`` (``SAVE/iter_XXXXXXX/`` + tracker file, atomic).
The file does not depend on the shard layout or on the fractions: loading reads the full tensors
and keeps the loader's own pieces. Because the format is the pipeline runtime's, a sharded run's
checkpoint resumes under any pipeline Plan (``HeteroTrainer.load_checkpoint``) and a pipeline
run's checkpoint resumes under any ShardedPlan.
"""

from __future__ import annotations

import os

import torch

from megatron_het.checkpoint.dist_ckpt import CheckpointError, TensorSlot, model_common_state
from megatron_het.checkpoint.full_state import local_shards
from megatron_het.train.data_position import position_from_checkpoint

__all__ = ["save_sharded", "load_sharded"]


def _slots(strategy, full: dict[str, torch.Tensor]) -> dict[str, TensorSlot]:
    """Full tensors as dist_ckpt slots; TP layout marks (partition dim, gated fc1) as the pipeline
    runtime's at TP=1, so both write the same keys."""
    meta = local_shards(strategy.gpt, layer_offset=0, tp_rank=0, tp_size=1, tied=strategy.tied,
                        gated=strategy.model_spec.swiglu)
    return {name: TensorSlot(tensor=full[name], partition_dim=meta[name].partition_dim, tp_rank=0, tp_size=1,
                             main=strategy.rank == 0, glu=meta[name].glu) for name in strategy.index.names}


def save_sharded(strategy, save: str, iteration: int, *, tokenizer_model: str | None = None) -> str:
    """Write the full state of ``strategy`` (a ``sharding.trainer.ShardedStrategy``) after ``iteration`` steps under directory ``save`` (collective).
    Returns the iteration directory."""
    from megatron_het.checkpoint.dist_ckpt import save_checkpoint

    model, moments = strategy.optimizer.local_state()  # full tensors: every rank holds every parameter
    common = {"model": model_common_state(strategy.model_spec), "padded_vocab": strategy.stage.vocab_size,
              "consumed_samples": strategy.data_position.consumed_at(iteration, strategy.train.global_batch_size),
              "plan": strategy.plan.to_dict(), "seed": strategy.train.seed}
    return save_checkpoint(save, iteration, params=_slots(strategy, model), optimizer_state=moments,
                           common=common, tokenizer_model=tokenizer_model)


@torch.no_grad()
def load_sharded(strategy, path: str, *, with_optimizer: bool = True) -> int:
    """Load an iteration directory written under any shard layout or plan; returns its iteration (collective)."""
    from megatron_het.checkpoint.dist_ckpt import load_checkpoint, read_common

    vocab = read_common(path).get("padded_vocab") if os.path.isdir(path) else strategy.stage.vocab_size
    if vocab != strategy.stage.vocab_size:  # checked first: the shape error below would not say why
        raise CheckpointError(
            f"{path}: padded_vocab: the checkpoint has {vocab} embedding rows, this strategy builds "
            f"{strategy.stage.vocab_size}. Fix: construct the trainer with padded_vocab={vocab}")
    empty = {n: torch.empty(strategy.shapes[n], device=strategy.device) for n in strategy.index.names}
    common, values, moments = load_checkpoint(path, params=_slots(strategy, empty), model=strategy.model_spec,
                                              with_optimizer=with_optimizer)
    iteration = int(common["iteration"])
    strategy.data_position = position_from_checkpoint(common, strategy.train.global_batch_size)
    strategy.optimizer.load_local_state(values, moments if with_optimizer else None, step=iteration)
    return iteration
