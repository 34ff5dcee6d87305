"""Whether a plan overlaps its gradient reduction with the backward: the variants the runtime can run.

megatron-het's runtime (``runtime/overlap_grad.py``) launches every stage's gradient all-reduce in
buckets during that stage's last backward when the plan records ``overlap_grad_reduce``; with the
distributed optimizer it does the same (each owner then takes its pieces of the sums,
``optim/distributed.py``) and gathers the updated weights during the next forward
(--overlap-param-gather). So a plan has up to two overlapped variants: with the distributed
optimizer kept (sharded Adam state and step; the all-reduce moves twice a reduce-scatter's bytes,
hidden behind the backward) and without it (unsharded state and step, no gather). ``perf.predict``
prices each as the runtime runs it (bridged cross-vendor buckets and interleaved stages not
overlapped); the planner keeps the fastest that fits (``search.plan_cluster``).
"""

from __future__ import annotations

from dataclasses import replace

from megatron_het.perf.predict import Prediction
from megatron_het.plan.types import Plan

__all__ = ["overlap_note", "overlap_variants"]


def overlap_variants(plan: Plan) -> list[Plan] | str:
    """``plan`` with its gradient reduction overlapped: with the distributed optimizer kept when the
    plan has it, and without it; or why there is none."""
    if plan.overlap_grad_reduce:
        return "the plan overlaps already"
    if len(plan.replicas) < 2:
        return "one replica: no gradient reduction across replicas"
    if plan.virtual_pipeline_size > 1:
        return "interleaved stages: the runtime overlaps only the last model chunk's buckets (priced as none)"
    plain = replace(plan, use_distributed_optimizer=False, overlap_grad_reduce=True, predicted=None)
    if plan.use_distributed_optimizer:
        return [replace(plan, overlap_grad_reduce=True, predicted=None), plain]
    return [plain]


def overlap_note(chosen: tuple[Plan, Prediction], synchronous: Prediction | None) -> str:
    """One sentence for the explanation when the chosen plan overlaps; '' when it does not.
    ``synchronous``: the prediction of the form it was derived from (reduction after the backward)."""
    plan, pred = chosen
    if not plan.overlap_grad_reduce:
        return ""
    if plan.use_distributed_optimizer:
        how = ("with the distributed optimizer: each owner takes its pieces of the sums and the updated weights "
               "are gathered during the next forward, --overlap-param-gather")
        alt_form = "the same without overlap (reduce-scatter after the backward)"
    else:
        how = "no distributed optimizer"
        alt_form = "with the distributed optimizer instead (reduce-scatter after the backward)"
    alt = (f"; {alt_form} {synchronous.iteration_time_s:.4g} s, {synchronous.gradient_reduction_s:.3g} s exposed"
           if synchronous is not None else "")
    return (f"Gradient reduction: all-reduce buckets overlapped with each stage's last backward (the runtime's "
            f"--overlap-grad-reduce, recorded in the plan; {how}), "
            f"{pred.gradient_reduction_s:.3g} s exposed, predicted {pred.iteration_time_s:.4g} s/iteration "
            f"under 1F1B{alt}.")
