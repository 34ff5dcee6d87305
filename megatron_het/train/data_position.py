"""Where the training data stands: Megatron-LM's consumed-samples count.

A run that starts fresh reads samples ``0, 1, 2, ...``: iteration ``t`` (0-based) reads the
``global_batch_size`` samples from ``t * global_batch_size``. A run resumed from a checkpoint
continues from the checkpoint's ``consumed_samples`` instead, as Megatron-LM does, so a changed
``--global-batch-size`` continues where the data stopped (``iteration * global_batch_size`` would
re-read or skip samples). Checkpoints without the count (none written here lack it, but other tools'
may) resume at ``iteration * global_batch_size``, as before the count was read.

Every place that derives a data offset or logs the count uses ``DataPosition.consumed_at``: the
strategies' batches (``positioned_batches``), the saved ``consumed_samples`` and the log lines.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megatron_het.errors import UserError


@dataclass(frozen=True)
class DataPosition:
    """``consumed_samples`` training samples were read in the first ``iteration`` iterations; every
    later iteration reads one global batch more. The default is a fresh run."""

    iteration: int = 0
    consumed_samples: int = 0

    def consumed_at(self, iteration: int, global_batch_size: int) -> int:
        """Samples read before 0-based ``iteration`` (= consumed after ``iteration`` steps): the first
        sample index of that iteration's global batch."""
        return self.consumed_samples + (iteration - self.iteration) * global_batch_size


def position_from_checkpoint(common: Mapping[str, Any], global_batch_size: int) -> DataPosition:
    """The data position a checkpoint's common state records (its ``consumed_samples``; without one,
    ``iteration * global_batch_size`` of this run, as runs resumed before the count was read)."""
    iteration = int(common["iteration"])
    consumed = common.get("consumed_samples")
    return DataPosition(iteration, iteration * global_batch_size if consumed is None else int(consumed))


def consumed_samples(strategy: Any, iteration: int, global_batch_size: int) -> int:
    """Samples consumed after ``iteration`` steps of ``strategy`` (its ``data_position``; strategies
    without one read ``iteration * global_batch_size``)."""
    position = getattr(strategy, "data_position", None) or DataPosition()
    return position.consumed_at(iteration, global_batch_size)


def check_resumed_data(batch_fn: Any, position: DataPosition | None, *, train_iters: int,
                       global_batch_size: int) -> None:
    """Refuse, at load time and on every rank alike, a resumed run whose data split ends before its last
    iteration (instead of failing mid-step): a larger consumed-samples count than the split was sized
    for (``GptDataConfig.resume_consumed_samples``). Batch functions that are not sample-addressed
    (mock data) have no end."""
    split = getattr(batch_fn, "split", None)
    if position is None or split is None or not hasattr(batch_fn, "samples"):
        return
    need, available = position.consumed_at(train_iters, global_batch_size), split.num_samples
    if need <= available:
        return
    before = (f" (its global batch size: {position.consumed_samples // position.iteration})"
              if position.iteration and position.consumed_samples % position.iteration == 0 else "")
    raise UserError(f"the checkpoint's run consumed {position.consumed_samples} training samples in "
                    f"{position.iteration} iterations; iterations {position.iteration + 1}-{train_iters} at global "
                    f"batch size {global_batch_size} read samples up to {need - 1}, but the train split has "
                    f"{available}", field="--load", value=position.consumed_samples,
                    fix=f"resume with the checkpoint's global batch size{before}, fewer --train-iters, or a "
                        "larger corpus")


def positioned_batches(batch_fn: Any, position: DataPosition, global_batch_size: int):
    """``batch_fn`` as the strategies call it, ``(iteration, indices)``, reading iteration ``t``'s row
    ``i`` from sample ``position.consumed_at(t, global_batch_size) + i``.

    Sample-addressed batch functions (``data.gpt_data.gpt_batch_fn``: a ``samples(first, indices, *,
    iteration)`` method) follow the position; others (mock data: random tokens keyed by iteration, test batches)
    are returned as given.
    """
    samples = getattr(batch_fn, "samples", None)
    if samples is None:
        return batch_fn

    def batch(iteration: int, indices: range) -> torch.Tensor:
        return samples(position.consumed_at(iteration, global_batch_size), indices, iteration=iteration)

    return batch
