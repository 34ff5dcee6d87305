"""Learning rates are Megatron-LM's (#35 item 5): megatron-core's OptimizerParamScheduler driven the
way Megatron-LM's training loop drives it (a real optimizer, ``step(increment=global batch)`` after
every iteration) gives the same rate for every iteration as ``TrainConfig.lr_at``."""

from __future__ import annotations

import math

import pytest
import torch

import megatron_het.platform  # noqa: F401  (import guards)
from megatron_het.runtime.arguments import parse_args
from megatron_het.train.config import TrainConfig
from megatron_het.train.lr_schedule import lr_at

from support.paths import REPO

GBS = 8


def _megatron_loop_rates(train: TrainConfig, iters: int, **steps) -> list[float]:
    """Megatron-LM: get_optimizer_param_scheduler's arguments, then one step(increment=gbs) per iteration;
    iteration i runs with the rate the optimizer holds before its step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=train.lr_warmup_init, max_lr=train.lr, min_lr=train.min_lr,
                                        start_wd=0.01, end_wd=0.01, wd_incr_steps=iters * GBS,
                                        wd_incr_style="constant", lr_decay_style=train.lr_decay_style,
                                        lr_wsd_decay_style=train.lr_wsd_decay_style, **steps)
    rates = []
    for _ in range(iters):
        rates.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=GBS)
    return rates


CASES = [  # (TrainConfig overrides, Megatron's step counts in samples)
    (dict(lr_decay_style="constant"), dict(lr_warmup_steps=0, lr_decay_steps=12 * GBS)),
    (dict(lr_decay_style="linear", lr_warmup_iters=3), dict(lr_warmup_steps=3 * GBS, lr_decay_steps=12 * GBS)),
    (dict(lr_decay_style="cosine", lr_warmup_iters=2, min_lr=1e-4, lr_decay_iters=8),
     dict(lr_warmup_steps=2 * GBS, lr_decay_steps=8 * GBS)),
    (dict(lr_decay_style="cosine", lr_warmup_fraction=0.25, lr_warmup_init=1e-5),
     dict(lr_warmup_steps=0.25 * 12 * GBS, lr_decay_steps=12 * GBS)),
    (dict(lr_decay_style="inverse-square-root", lr_warmup_iters=4), dict(lr_warmup_steps=4 * GBS,
                                                                         lr_decay_steps=12 * GBS)),
    (dict(lr_decay_style="WSD", lr_wsd_decay_iters=5, lr_wsd_decay_style="cosine", min_lr=1e-5),
     dict(lr_warmup_steps=0, lr_decay_steps=12 * GBS, wsd_decay_steps=5 * GBS)),
    (dict(lr_decay_style="linear", train_samples=12 * GBS + 3, lr_warmup_samples=20),
     dict(lr_warmup_steps=20, lr_decay_steps=12 * GBS + 3)),
]


@pytest.mark.parametrize("overrides,steps", CASES, ids=[c[0]["lr_decay_style"] + str(i) for i, c in enumerate(CASES)])
def test_every_iterations_rate_is_megatrons(overrides, steps):
    train = TrainConfig(micro_batch_size=1, global_batch_size=GBS, train_iters=12, lr=3e-4, **overrides)
    assert [lr_at(train, i) for i in range(14)] == _megatron_loop_rates(train, 14, **steps)


def test_cosine_by_hand():
    """Independent of megatron-core: warm-up from 0 over 2 iterations, then half a cosine to min_lr."""
    train = TrainConfig(micro_batch_size=1, global_batch_size=GBS, train_iters=10, lr=1.0, min_lr=0.1,
                        lr_warmup_iters=2, lr_decay_style="cosine")
    expected = [0.0, 0.5] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (i - 2) / 8)) for i in range(2, 11)]
    assert [lr_at(train, i) for i in range(11)] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("overrides,message", [
    (dict(lr_decay_style="WSD"), "--lr-wsd-decay-iters"),
    (dict(lr_warmup_iters=12), r"warm-up \(96 samples\) must be shorter than the decay \(96 samples\)"),
    (dict(min_lr=1.0), "--min-lr 1.0"),
    (dict(lr_decay_style="step"), "inverse-square-root, WSD"),
])
def test_impossible_schedules_name_the_flag(overrides, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(micro_batch_size=1, global_batch_size=GBS, train_iters=12, lr=3e-4, **overrides)


BASE = ["--hetero-cluster", str(REPO / "examples/clusters/cpu-demo.yaml"), "--hetero-model",
        str(REPO / "examples/models/tiny-cpu.yaml"), "--hetero-plan", str(REPO / "examples/plans/cpu-demo-hetero.json"),
        "--lr", "1e-3", "--mock-data"]


def test_train_samples_sets_the_iterations_as_megatron():
    args = parse_args(BASE + ["--train-samples", "70", "--lr-warmup-samples", "16", "--lr-decay-style", "cosine"])
    assert (args.train.train_iters, args.train.global_batch_size) == (4, 16)  # 70 // 16, the plan's batch
    assert lr_at(args.train, 0) == 0.0 and lr_at(args.train, 1) == pytest.approx(1e-3)


def test_iterations_and_samples_together_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--train-iters", "3", "--train-samples", "48"])
    assert "give one of --train-iters and --train-samples" in capsys.readouterr().err
