"""The plan is the one record of precision and optimizer sharding (runtime/plan_record.py)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_het.cluster import ConfigError
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.runtime.plan_record import reconcile_plan
from megatron_het.train.config import TrainConfig

PLAN = Plan(replicas=(ReplicaPlan(stages=(StagePlan(island="a", device_type="CPU", ranks=(0,), layers=(0, 2)),),
                                  num_micro_batches=2),), micro_batch_size=1, global_batch_size=2)
TRAIN = TrainConfig(micro_batch_size=1, global_batch_size=2, train_iters=1)


@pytest.mark.parametrize("plan_precision,runs", [("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"),
                                                 ("tf32", "fp32")])
def test_without_a_flag_the_run_takes_the_plans_precision(plan_precision, runs):
    _, train = reconcile_plan(dataclasses.replace(PLAN, precision=plan_precision), TRAIN)
    assert train.precision == runs


def test_a_flag_that_contradicts_the_plan_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"--fp16.*priced at bf16.*asks for fp16"):
        reconcile_plan(dataclasses.replace(PLAN, precision="bf16"), dataclasses.replace(TRAIN, fp16=True))
    _, train = reconcile_plan(dataclasses.replace(PLAN, precision="bf16"), dataclasses.replace(TRAIN, bf16=True))
    assert train.precision == "bf16"


def test_fp8_plans_are_refused():
    with pytest.raises(ConfigError, match="fp8"):
        reconcile_plan(dataclasses.replace(PLAN, precision="fp8"), TRAIN)


def test_the_flag_turns_the_plans_distributed_optimizer_on_and_the_plan_records_it():
    plan, _ = reconcile_plan(PLAN, TRAIN, use_distributed_optimizer=True)
    assert plan.use_distributed_optimizer
    plan, _ = reconcile_plan(dataclasses.replace(PLAN, use_distributed_optimizer=True), TRAIN)
    assert plan.use_distributed_optimizer  # no flag: the plan's record stands


def test_a_plan_recording_gradient_overlap_runs_it_and_the_flag_records_it():
    _, train = reconcile_plan(dataclasses.replace(PLAN, overlap_grad_reduce=True), TRAIN)
    assert train.overlap_grad_reduce  # the planner priced the overlap: the run overlaps without the flag
    plan, train = reconcile_plan(PLAN, dataclasses.replace(TRAIN, overlap_grad_reduce=True))
    assert plan.overlap_grad_reduce and train.overlap_grad_reduce
    plan, _ = reconcile_plan(PLAN, TRAIN)
    assert not plan.overlap_grad_reduce


def test_the_overlap_flag_is_recorded_beside_the_distributed_optimizer_too():
    """The runtime overlaps the distributed optimizer's buckets (and, recorded, its gather): the run's plan
    must say so, or the prediction it prints and the checkpoint's plan describe a reduce-scatter after the
    backward while the run all-reduces during it."""
    flags = dataclasses.replace(TRAIN, overlap_grad_reduce=True)
    plan, train = reconcile_plan(dataclasses.replace(PLAN, use_distributed_optimizer=True), flags)
    assert plan.use_distributed_optimizer and plan.overlap_grad_reduce and train.overlap_grad_reduce
    plan, _ = reconcile_plan(PLAN, flags, use_distributed_optimizer=True)
    assert plan.use_distributed_optimizer and plan.overlap_grad_reduce
