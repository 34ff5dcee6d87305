"""The plan is the one record of what a run prices and runs: precision and optimizer sharding.

The planner prices a plan at ``Plan.precision`` with ``Plan.use_distributed_optimizer``;
``tools/predict.py`` reads both from the plan; the pipeline runtime runs exactly them. The
command line may add to the record but not contradict it (pure function, applied in
``cli/pretrain.py`` before anything is built):

- precision: no ``--bf16``/``--fp16`` flag means "what the plan says" (fp32 and tf32 plans train in
  fp32 storage); a flag that names another precision than the plan's is refused, naming both;
  fp8 plans are refused (this runtime has no fp8 path). A sharded plan records only its precision
  (``reconcile_precision``; one written before the field records none, and the flags decide);
- ``--hetero-plan auto`` has no plan file: the flags are the record (no flag = fp32, Megatron's
  default) and the chosen plan records them (``cli/pretrain.resolve_plan``);
- ``--use-distributed-optimizer`` turns the plan's ``use_distributed_optimizer`` on (and the run's
  plan records it, so the memory prediction the run prints counts sharded state);
- gradient overlap: a plan recording ``overlap_grad_reduce`` (the planner chose and priced it) runs
  with ``TrainConfig.overlap_grad_reduce`` on without the flag; ``--overlap-grad-reduce`` on a plan
  without it records it in the run's plan (so the prediction the run prints prices the overlap, and
  with the distributed optimizer the run gathers the updated weights during the next forward, as
  priced).
"""

from __future__ import annotations

import dataclasses

from megatron_het.cluster import ConfigError
from megatron_het.plan import Plan
from megatron_het.plan.types import TRAINS_IN
from megatron_het.train.config import TrainConfig

__all__ = ["reconcile_plan", "reconcile_precision"]


def reconcile_precision(precision: str | None, train: TrainConfig) -> TrainConfig:
    """``train`` running the plan's recorded ``precision`` (either plan kind; None, a sharded plan from
    before the field: the flags decide); raises ConfigError when a flag names another one."""
    if precision is None:
        return train
    if precision not in TRAINS_IN:
        raise ConfigError(f"the plan was priced at {precision}, which this runtime does not train in",
                          field="plan.precision", value=precision,
                          fix="re-plan with precision fp32, bf16 or fp16")
    runs = TRAINS_IN[precision]
    if train.precision != "fp32" and train.precision != runs:
        raise ConfigError(f"the plan was priced at {precision}, the flag asks for {train.precision}",
                          field=f"--{train.precision}", value=train.precision,
                          fix=f"drop --{train.precision} (the plan's {precision} is used) or re-plan at "
                              f"{train.precision}")
    return dataclasses.replace(train, bf16=runs == "bf16", fp16=runs == "fp16")


def reconcile_plan(plan: Plan, train: TrainConfig, *, use_distributed_optimizer: bool = False
                   ) -> tuple[Plan, TrainConfig]:
    """(plan, train) that agree on precision, optimizer sharding and gradient overlap; raises ConfigError on a conflict."""
    train = reconcile_precision(plan.precision, train)
    if use_distributed_optimizer and not plan.use_distributed_optimizer:
        plan = dataclasses.replace(plan, use_distributed_optimizer=True)
    if plan.overlap_grad_reduce and not train.overlap_grad_reduce:
        train = dataclasses.replace(train, overlap_grad_reduce=True)
    elif train.overlap_grad_reduce and not plan.overlap_grad_reduce:  # with the distributed optimizer too
        plan = dataclasses.replace(plan, overlap_grad_reduce=True)
    return plan, train
