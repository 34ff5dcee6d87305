"""Automatic heterogeneous planner: islands as units, closed-form pricing, full prediction of the best."""

from megatron_het.planner.errors import InfeasibleError
from megatron_het.planner.estimate import Estimate, Estimator
from megatron_het.planner.explain import describe_plan, island_infeasibility
from megatron_het.planner.modes import MODES, ModeChoice, plan_best
from megatron_het.planner.search import PlannerResult, plan_cluster, with_seq_length
from megatron_het.planner.sharded import plan_sharded
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
    "MODES",
    "ModeChoice",
    "PlannerResult",
    "Segment",
    "Template",
    "allocate_micro_batches",
    "balanced_split",
    "balanced_split_options",
    "build_plan",
    "describe_plan",
    "island_infeasibility",
    "plan_best",
    "plan_cluster",
    "plan_sharded",
    "tp_options",
    "with_seq_length",
]
