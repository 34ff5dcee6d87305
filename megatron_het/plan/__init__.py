"""Plan types, validation, JSON and rank layout (pure functions)."""

from megatron_het.plan.errors import PlanError
from megatron_het.plan.layout import (
    RankRole,
    chunk_layers,
    homogeneous_plan,
    layer_split,
    rank_roles,
    role_of,
)
from megatron_het.plan.serialize import plan_from_dict, plan_to_dict
from megatron_het.plan.types import PLAN_FORMAT, PLAN_FORMAT_VERSION, Plan, ReplicaPlan, StagePlan
from megatron_het.plan.validate import MemoryCheck, validate_plan

__all__ = [
    "PLAN_FORMAT",
    "PLAN_FORMAT_VERSION",
    "MemoryCheck",
    "Plan",
    "PlanError",
    "RankRole",
    "ReplicaPlan",
    "StagePlan",
    "chunk_layers",
    "homogeneous_plan",
    "layer_split",
    "plan_from_dict",
    "plan_to_dict",
    "rank_roles",
    "role_of",
    "validate_plan",
]
