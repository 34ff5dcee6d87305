"""Automatic heterogeneous planner: islands as units, closed-form pricing, full prediction of the best."""

from megatron_het.planner.errors import InfeasibleError
from megatron_het.planner.estimate import Estimate, Estimator
from megatron_het.planner.explain import describe_plan, island_infeasibility
from megatron_het.planner.search import PlannerResult, plan_cluster, with_seq_length
from megatron_het.planner.space import (
    Segment,
    Template,
    allocate_micro_batches,
    balanced_split,
    balanced_split_options,
    build_plan,
    tp_options,
)

__all__ = [
    "Estimate",
    "Estimator",
    "InfeasibleError",
    "PlannerResult",
    "Segment",
    "Template",
    "allocate_micro_batches",
    "balanced_split",
    "balanced_split_options",
    "build_plan",
    "describe_plan",
    "island_infeasibility",
    "plan_cluster",
    "tp_options",
    "with_seq_length",
]
