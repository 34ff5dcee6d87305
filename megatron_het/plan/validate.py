"""Checks of a plan of either kind against a model (and optionally a cluster).

The checks themselves live with each kind (``Plan.validate`` -> plan/checks.py, ``ShardedPlan.validate``);
these are the entry points other packages call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_het.plan import checks
from megatron_het.plan.errors import PlanError
from megatron_het.plan.interface import AnyPlan, MemoryCheck
from megatron_het.plan.types import Plan

if TYPE_CHECKING:
    from megatron_het.cluster import ClusterSpec, ModelSpec

__all__ = ["MemoryCheck", "check_runtime_tp_grid", "check_schedule", "check_tp_comm_overlap", "validate_plan"]


def validate_plan(plan: AnyPlan, model: ModelSpec, cluster: ClusterSpec | None = None, *,
                  memory_check: MemoryCheck | None = None) -> None:
    """Raise PlanError for the first problem found; return None for a runnable plan (either kind)."""
    plan.validate(model, cluster, memory_check=memory_check)


def check_tp_comm_overlap(plan: Plan) -> None:
    """``tp_comm_overlap`` chunks the all-gather/reduce-scatter of sequence parallelism: it needs it."""
    checks.check_tp_comm_overlap(plan.replicas, plan.sequence_parallel)


def check_runtime_tp_grid(plan: Plan) -> None:
    """The pipeline runtime builds 1D tensor-parallel stages only: a stage with ``tp_grid`` (AxoNN 3D
    tensor parallelism; planned and priced, tp/linear3d.py has the layer) is refused here rather than
    silently run as something else."""
    for ri, r in enumerate(plan.replicas):
        for si, s in enumerate(r.stages):
            if s.tp_grid is not None:
                raise PlanError(
                    field=f"replicas[{ri}].stages[{si}].tp_grid", value=list(s.tp_grid),
                    problem=f"the runtime cannot build a 3D tensor-parallel stage yet (grid {list(s.tp_grid)} over "
                    f"{len(s.ranks)} ranks): its layer spec, stage boundaries, gradient reduction and "
                    "checkpoint mapping for 3D layouts are not implemented (issue #20, item 3)",
                    fix=f'remove "tp_grid" to run this stage as 1D tensor parallelism over its {len(s.ranks)} '
                    "ranks, or plan with the Megatron parallelizer",
                )


def check_schedule(plan: Plan, model: ModelSpec) -> None:
    """The plan's schedule and virtual pipeline size are ones the runtime implements (PlanError naming them)."""
    checks.check_schedule(plan.replicas, plan.schedule, plan.virtual_pipeline_size, model.num_layers)
