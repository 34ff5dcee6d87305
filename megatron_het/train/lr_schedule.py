"""The learning rate of each iteration: megatron-core's ``OptimizerParamScheduler``, set up as
Megatron-LM's ``get_optimizer_param_scheduler`` sets it up (steps counted in samples; decay over
``--lr-decay-iters``/``--lr-decay-samples``, warm-up by iterations, samples or fraction, WSD and
inverse-square-root), so a run's learning rates are Megatron's to the last bit (the step counts: ``TrainConfig.schedule_steps``).

Only its learning-rate math is used: our optimizers take the rate per step
(``Strategy.step(lr=...)``), because one uneven plan has several optimizers (one per holder set),
and a scheduler that writes into one optimizer's param groups would have to be kept in step with
each. The scheduler is built with no param groups and asked for the rate at a step count.
"""

from __future__ import annotations

import functools
import types

import megatron_het.platform  # noqa: F401  (import guards before megatron.core)
from megatron_het.train.config import TrainConfig


@functools.lru_cache(maxsize=8)
def _scheduler(train: TrainConfig):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    steps = train.schedule_steps()
    return OptimizerParamScheduler(
        types.SimpleNamespace(param_groups=[]), init_lr=train.lr_warmup_init, max_lr=train.lr, min_lr=train.min_lr,
        lr_decay_style=train.lr_decay_style, start_wd=train.weight_decay, end_wd=train.weight_decay,
        wd_incr_steps=max(1, train.train_iters * train.global_batch_size), wd_incr_style="constant",
        lr_wsd_decay_style=train.lr_wsd_decay_style, **steps)


def lr_at(train: TrainConfig, iteration: int, *, group: dict | None = None) -> float:
    """The learning rate of 0-based ``iteration`` (Megatron: the scheduler has stepped ``iteration``
    global batches when that iteration's optimizer step runs). ``group``: an optimizer param group
    whose ``max_lr``/``min_lr`` replace --lr/--min-lr, as megatron-core's scheduler reads them."""
    scheduler = _scheduler(train)
    scheduler.num_steps = iteration * train.global_batch_size
    return float(scheduler.get_lr(group or {}))


def decoupled_lr_at(train: TrainConfig, iteration: int) -> float | None:
    """The rate of the word embedding and output layer under --decoupled-lr (None without it):
    megatron-core's param-group override (``max_lr`` = --decoupled-lr, ``min_lr`` =
    --decoupled-min-lr when given) on the run's schedule."""
    if train.decoupled_lr is None:
        return None
    group = {"max_lr": train.decoupled_lr}
    if train.decoupled_min_lr is not None:
        group["min_lr"] = train.decoupled_min_lr
    return lr_at(train, iteration, group=group)


def is_decoupled(name: str) -> bool:
    """Whether the global parameter ``name`` takes --decoupled-lr: megatron-core marks the word
    embedding and the output layer (``is_embedding_or_output_parameter``)."""
    from megatron_het.checkpoint.full_state import TIED_OUTPUT, WORD_EMBEDDING

    return name in (WORD_EMBEDDING, TIED_OUTPUT)
