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


def lr_at(train: TrainConfig, iteration: int) -> float:
    """The learning rate of 0-based ``iteration`` (Megatron: the scheduler has stepped ``iteration``
    global batches when that iteration's optimizer step runs)."""
    scheduler = _scheduler(train)
    scheduler.num_steps = iteration * train.global_batch_size
    return float(scheduler.get_lr({}))
