"""Whether a plan overlaps its gradient reduction with the backward: the variant the runtime can run.

megatron-het's runtime (``runtime/overlap_grad.py``) launches every stage's gradient all-reduce in
buckets during that stage's last backward when the plan records ``overlap_grad_reduce``; it refuses
the overlap with the distributed optimizer (whose reduce-scatter runs after the backward), so the
overlapped variant of a plan is the same layout without optimizer sharding: less exposed reduction,
more memory per rank (unsharded Adam state) and an unsharded optimizer step. ``perf.predict`` prices
both as the runtime runs them (bridged cross-vendor buckets and interleaved stages not overlapped);
the planner keeps the faster one that fits (``search.plan_cluster``).
"""

from __future__ import annotations

from dataclasses import replace

from megatron_het.perf.predict import Prediction
from megatron_het.plan.types import Plan

__all__ = ["overlap_note", "overlap_variant"]


def overlap_variant(plan: Plan) -> Plan | str:
    """``plan`` with the gradient all-reduce overlapped (distributed optimizer off), or why there is none."""
    if plan.overlap_grad_reduce:
        return "the plan overlaps already"
    if len(plan.replicas) < 2:
        return "one replica: no gradient reduction across replicas"
    if plan.virtual_pipeline_size > 1:
        return "interleaved stages: the runtime overlaps only the last model chunk's buckets (priced as none)"
    return replace(plan, use_distributed_optimizer=False, overlap_grad_reduce=True, predicted=None)


def overlap_note(chosen: tuple[Plan, Prediction], sharded: Prediction | None) -> str:
    """One sentence for the explanation when the chosen plan overlaps; '' when it does not."""
    plan, pred = chosen
    if not plan.overlap_grad_reduce:
        return ""
    alt = (f"; with the distributed optimizer instead (reduce-scatter after the backward) "
           f"{sharded.iteration_time_s:.4g} s, {sharded.gradient_reduction_s:.3g} s exposed" if sharded is not None
           else "")
    return (f"Gradient reduction: all-reduce buckets overlapped with each stage's last backward (the runtime's "
            f"--overlap-grad-reduce, recorded in the plan; no distributed optimizer), "
            f"{pred.gradient_reduction_s:.3g} s exposed, predicted {pred.iteration_time_s:.4g} s/iteration "
            f"under 1F1B{alt}.")
