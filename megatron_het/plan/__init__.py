"""Plans of both kinds (pipeline ``Plan``, ``ShardedPlan``), their one interface, validation, JSON,
and the rank layout (pure functions)."""

from megatron_het.plan.errors import PlanError
from megatron_het.plan.interface import AnyPlan, MemoryCheck
from megatron_het.plan.layout import (
    RankRole,
    chunk_layers,
    homogeneous_plan,
    layer_split,
    rank_roles,
    role_of,
    uneven_chunk_layers,
)
from megatron_het.plan.serialize import (
    any_plan_from_dict,
    load_any_plan,
    plan_to_json,
    save_plan,
)
from megatron_het.plan.sharded import SHARDED_PLAN_FORMAT, SHARDED_PLAN_VERSION, RankShare, ShardedPlan
from megatron_het.plan.types import PLAN_FORMAT, PLAN_FORMAT_VERSION, Plan, ReplicaPlan, StagePlan
from megatron_het.plan.validate import validate_plan

__all__ = [
    "PLAN_FORMAT",
    "PLAN_FORMAT_VERSION",
    "SHARDED_PLAN_FORMAT",
    "SHARDED_PLAN_VERSION",
    "AnyPlan",
    "MemoryCheck",
    "Plan",
    "PlanError",
    "RankRole",
    "RankShare",
    "ReplicaPlan",
    "ShardedPlan",
    "StagePlan",
    "any_plan_from_dict",
    "chunk_layers",
    "homogeneous_plan",
    "layer_split",
    "uneven_chunk_layers",
    "load_any_plan",
    "plan_to_json",
    "rank_roles",
    "role_of",
    "save_plan",
    "validate_plan",
]
