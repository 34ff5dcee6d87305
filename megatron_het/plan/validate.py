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
    """The pipeline runtime builds a stage with ``tp_grid`` (AxoNN 3D tensor parallelism,
    model/tp3d_stage.py) except where a piece is still missing; such a plan is refused here, naming
    the stage and the reason, rather than run as something else. With ``sequence_parallel`` a 3D
    stage runs without it (z splits the batch; its boundaries carry whole sequences) beside
    sequence-parallel 1D stages, in its replica or in others (tests/multiproc/test_runtime_tp3d_parity.py)."""
    for ri, r in enumerate(plan.replicas):
        for si, s in enumerate(r.stages):
            if s.tp_grid is None:
                continue
            missing = [(cond, what, fix) for cond, what, fix in (
                (plan.virtual_pipeline_size > 1, f"interleaved model chunks (virtual_pipeline_size "
                 f"{plan.virtual_pipeline_size}) on a 3D stage", 'use virtual_pipeline_size 1'),
                (plan.use_distributed_optimizer, "the distributed optimizer's shards of 3D blocks",
                 'set "use_distributed_optimizer": false'),
                (plan.micro_batch_size % s.tp_grid[2] != 0, f"micro_batch_size {plan.micro_batch_size} not divisible "
                 f"by the grid's z = {s.tp_grid[2]} (z splits the batch)", "choose z dividing the micro-batch size"),
            ) if cond]
            if missing:
                _, what, fix = missing[0]
                raise PlanError(
                    field=f"replicas[{ri}].stages[{si}].tp_grid", value=list(s.tp_grid),
                    problem=f"the runtime cannot build this 3D tensor-parallel stage (grid {list(s.tp_grid)} over "
                    f"{len(s.ranks)} ranks) with {what} yet (issue #20)",
                    fix=f'{fix}, or remove "tp_grid" to run this stage as 1D tensor parallelism over its '
                    f"{len(s.ranks)} ranks",
                )


def check_schedule(plan: Plan, model: ModelSpec) -> None:
    """The plan's schedule and virtual pipeline size are ones the runtime implements (PlanError naming them)."""
    checks.check_schedule(plan.replicas, plan.schedule, plan.virtual_pipeline_size, model.num_layers)
