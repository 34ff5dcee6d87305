"""Mode selection: the pipeline search (``plan_cluster``) and uneven sharded data parallelism
(``plan_sharded``, Cephalo) priced on the same inputs; the faster feasible plan wins.

Both predictions come from the same performance model family (``perf.predict`` for a Plan,
``perf.sharded`` for a ShardedPlan: same stage costs, same links, same device catalog), so their
iteration times are comparable. A tie goes to the pipeline (the longer-tested runtime).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from megatron_het.cluster import ClusterSpec, ModelSpec
from megatron_het.perf.bounds import check_global_batch_size
from megatron_het.perf.profile import Profile
from megatron_het.plan.types import Plan
from megatron_het.planner.errors import InfeasibleError
from megatron_het.planner.search import PlannerResult, plan_cluster, with_seq_length
from megatron_het.planner.sharded import plan_sharded
from megatron_het.sharding.plan import ShardedPlan

__all__ = ["MODES", "Mode", "ModeChoice", "plan_best"]

Mode = Literal["pipeline", "sharded"]
MODES: tuple[Mode, ...] = ("pipeline", "sharded")  # every mode plan_best can price


@dataclass(frozen=True, kw_only=True)
class ModeChoice:
    """The winning plan and both modes' predictions, side by side."""

    mode: Mode  # the chosen mode
    plan: Plan | ShardedPlan  # the chosen plan, ``predicted`` attached
    explanation: str  # one line: who won, by how much, or why the other mode is out
    pipeline_result: PlannerResult | None  # plan_cluster's answer (candidates, explanation), or None
    pipeline_time_s: float | None  # its predicted iteration time
    pipeline_reason: str | None  # why ``pipeline`` is None
    sharded: ShardedPlan | None  # plan_sharded's best; None when infeasible or not requested
    sharded_time_s: float | None  # its predicted iteration time
    sharded_reason: str | None  # why ``sharded`` is None

    @property
    def pipeline(self) -> Plan | None:
        """plan_cluster's best plan, if any."""
        return self.pipeline_result.best if self.pipeline_result is not None else None

    @property
    def speedup(self) -> float | None:
        """Pipeline time / sharded time (> 1: sharded is faster); None unless both fit."""
        if self.sharded_time_s is None or self.pipeline_time_s is None:
            return None
        return self.pipeline_time_s / self.sharded_time_s

    def to_json_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "explanation": self.explanation, "speedup_sharded_vs_pipeline": self.speedup,
                "pipeline_time_s": self.pipeline_time_s, "sharded_time_s": self.sharded_time_s,
                "pipeline_reason": self.pipeline_reason, "sharded_reason": self.sharded_reason,
                "pipeline": self.pipeline.to_dict() if self.pipeline is not None else None,
                "sharded": self.sharded.to_dict() if self.sharded else None}


_REASON_CHARS = 300  # an infeasibility reason is cut to this many characters in the one-line explanation


def _one_line(reason: str) -> str:
    text = " ".join(reason.split())
    return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS - 3] + "..."


def _explain(mode: Mode, p_time: float | None, s_time: float | None, p_reason: str | None,
             s_reason: str | None) -> str:
    if p_time is not None and s_time is not None:
        fast, slow = (s_time, p_time) if mode == "sharded" else (p_time, s_time)
        return (f"{mode} wins: {slow / fast:.2f}x predicted; pipeline best {p_time:.4g} s, sharded {s_time:.4g} s "
                "per iteration")
    if mode == "sharded":
        return f"sharded chosen ({s_time:.4g} s per iteration): pipeline {_one_line(p_reason or '')}"
    return f"pipeline chosen ({p_time:.4g} s per iteration): sharded {_one_line(s_reason or '')}"


def plan_best(model: ModelSpec, cluster: ClusterSpec, *, global_batch_size: int, modes: Sequence[Mode] = MODES,
              micro_batch_sizes: Sequence[int] = (1, 2, 4, 8), recompute_options: Sequence[bool] = (False, True),
              profile: Profile | Sequence[Profile] | None = None, islands: Sequence[str] | None = None,
              seq_length: int | None = None, sharded_options: Mapping[str, Any] | None = None,
              pipeline_options: Mapping[str, Any] | None = None) -> ModeChoice:
    """The fastest feasible plan over ``modes`` (``"pipeline"``, ``"sharded"`` or both).

    ``sharded_options`` go to ``plan_sharded`` (``shard_policy``, ``batch_policy``, ``precision``,
    ``capacity_bytes``, ``overhead_bytes``), ``pipeline_options`` to ``plan_cluster`` (``top_k``,
    ``exhaustive``, ``max_tp``, ...). Raises InfeasibleError with every mode's reason when none fits.
    """
    check_global_batch_size(global_batch_size)
    wanted = tuple(dict.fromkeys(modes))
    bad = [m for m in wanted if m not in MODES]
    if not wanted or bad:
        raise InfeasibleError(f"modes: must be a non-empty subset of {MODES} (got {tuple(modes)!r}). "
                              "Fix: pass e.g. modes=('pipeline', 'sharded')")
    model = with_seq_length(model, seq_length)
    result = sharded = None
    p_time = s_time = None
    p_reason = s_reason = f"not requested (modes={wanted})"
    if "pipeline" in wanted:
        try:
            result = plan_cluster(model, cluster, global_batch_size=global_batch_size, profile=profile,
                                  micro_batch_sizes=micro_batch_sizes, recompute_options=recompute_options,
                                  islands=islands, **dict(pipeline_options or {}))
            p_reason = None
            p_time = float(result.best.predicted["iteration_time_s"])
        except InfeasibleError as err:
            p_reason = f"infeasible: {err}"
    if "sharded" in wanted:
        try:
            sharded = plan_sharded(model, cluster, global_batch_size=global_batch_size,
                                   micro_batch_sizes=micro_batch_sizes, recompute_options=recompute_options,
                                   profile=profile, islands=islands, **dict(sharded_options or {}))
            s_reason = None
            s_time = float(sharded.predicted["iteration_time_s"])
        except InfeasibleError as err:
            s_reason = f"infeasible: {err}"
    pipeline = result.best if result is not None else None
    if pipeline is None and sharded is None:
        reasons = [f"{m}: {r}" for m, r in (("pipeline", p_reason), ("sharded", s_reason)) if m in wanted]
        raise InfeasibleError(f"no mode fits {model.name or 'the model'} on {cluster.num_gpus} GPUs: "
                              + " | ".join(reasons), reasons=tuple(reasons))
    mode: Mode = "sharded" if pipeline is None or (sharded is not None and s_time < p_time) else "pipeline"
    return ModeChoice(mode=mode, plan=sharded if mode == "sharded" else pipeline,
                      explanation=_explain(mode, p_time, s_time, p_reason, s_reason),
                      pipeline_result=result, pipeline_time_s=p_time, pipeline_reason=p_reason,
                      sharded=sharded, sharded_time_s=s_time, sharded_reason=s_reason)
