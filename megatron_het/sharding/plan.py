"""The sharded plan kind, re-exported where the sharded runtime has always imported it.

``ShardedPlan`` and ``RankShare`` live in the plan package (plan/sharded.py) beside the pipeline
``Plan``; both implement the one plan interface (plan/interface.py) and ``load_any_plan`` reads either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_het.plan.serialize import load_any_plan
from megatron_het.plan.sharded import SHARDED_PLAN_FORMAT, SHARDED_PLAN_VERSION, RankShare, ShardedPlan

if TYPE_CHECKING:
    from megatron_het.cluster import ClusterSpec

__all__ = ["SHARDED_PLAN_FORMAT", "SHARDED_PLAN_VERSION", "RankShare", "ShardedPlan", "describe_sharded_plan",
           "load_any_plan", "validate_sharded_plan"]


def validate_sharded_plan(plan: ShardedPlan, cluster: ClusterSpec) -> None:
    """Raise PlanError unless the plan fits ``cluster`` (``plan.validate`` without a model)."""
    plan.validate(None, cluster)


def describe_sharded_plan(plan: ShardedPlan) -> list[str]:
    """Human lines (``plan.describe()``)."""
    return plan.describe()
