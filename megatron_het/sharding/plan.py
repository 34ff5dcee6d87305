"""ShardedPlan: one data-parallel group whose ranks differ in batch share and state share (Cephalo).

Every rank runs the whole model (TP=1, PP=1) on its own micro-batches; the training state
(fp32 master weights, gradients after reduction, Adam moments) is split into uneven contiguous
shards. Compute share follows speed (``micro_batch_size x num_micro_batches``), state share follows
free memory (``shard_fraction``). Pure data + validation + JSON; the runtime and the planner read it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_het.plan.errors import PlanError

if TYPE_CHECKING:
    from megatron_het.cluster import ClusterSpec
    from megatron_het.plan.types import Plan

__all__ = ["SHARDED_PLAN_FORMAT", "SHARDED_PLAN_VERSION", "RankShare", "ShardedPlan", "describe_sharded_plan",
           "load_any_plan", "validate_sharded_plan"]

SHARDED_PLAN_FORMAT = "megatron-het-sharded-plan"  # "format" key of the JSON
SHARDED_PLAN_VERSION = 1  # "version" key this code reads and writes
_SUM_TOLERANCE = 1e-6  # shard fractions must sum to 1 within this


@dataclass(frozen=True, kw_only=True)
class RankShare:
    """What one rank computes and what it stores."""

    rank: int  # global rank (== position in ShardedPlan.ranks)
    island: str  # island of the rank's device
    device_type: str  # catalog name of the device
    micro_batch_size: int  # samples per micro-batch on this rank
    num_micro_batches: int  # micro-batches per iteration on this rank (0: state only, no compute)
    shard_fraction: float  # share of the flat training state this rank owns, in [0, 1]
    recompute: bool = False  # full activation recomputation on this rank

    def __post_init__(self) -> None:
        where = f"ranks[{self.rank}]"
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank: must be an integer >= 0 (got {self.rank!r}). Fix: number ranks from 0")
        if isinstance(self.micro_batch_size, bool) or not isinstance(self.micro_batch_size, int) \
                or self.micro_batch_size < 1:
            raise ValueError(f"{where}.micro_batch_size: must be an integer >= 1 (got {self.micro_batch_size!r}). "
                             "Fix: give every rank a positive micro-batch size")
        if isinstance(self.num_micro_batches, bool) or not isinstance(self.num_micro_batches, int) \
                or self.num_micro_batches < 0:
            raise ValueError(f"{where}.num_micro_batches: must be an integer >= 0 (got {self.num_micro_batches!r}). "
                             "Fix: pass 0 for a state-only rank")
        f = self.shard_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or not 0.0 <= f <= 1.0:
            raise ValueError(f"{where}.shard_fraction: must be in [0, 1] (got {f!r}). Fix: pass the rank's share "
                             "of the training state, e.g. 0.25")

    @property
    def samples(self) -> int:
        """Samples of the global batch this rank computes per iteration."""
        return self.micro_batch_size * self.num_micro_batches


@dataclass(frozen=True, kw_only=True)
class ShardedPlan:
    """Per-rank batch shares and state shares of one uneven sharded data-parallel group."""

    ranks: tuple[RankShare, ...]  # in rank order, ranks[i].rank == i
    global_batch_size: int  # samples per optimizer step; == sum of the ranks' samples
    predicted: Mapping[str, Any] | None = field(default=None, compare=False)  # perf-model figures, if priced

    def __post_init__(self) -> None:
        ranks = tuple(self.ranks)
        object.__setattr__(self, "ranks", ranks)
        if not ranks:
            raise ValueError("ranks: a sharded plan needs at least one rank (got 0). Fix: add a RankShare per GPU")
        for i, r in enumerate(ranks):
            if not isinstance(r, RankShare):
                raise ValueError(f"ranks[{i}]: must be a RankShare (got {type(r).__name__}). Fix: build RankShare")
            if r.rank != i:
                raise ValueError(f"ranks[{i}].rank: must equal its position {i} (got {r.rank}). "
                                 "Fix: list ranks in order 0..N-1")
        samples = sum(r.samples for r in ranks)
        if samples != self.global_batch_size:
            raise ValueError(f"global_batch_size: the ranks compute {samples} samples per iteration but "
                             f"global_batch_size is {self.global_batch_size}. Fix: make the sum of "
                             "micro_batch_size x num_micro_batches equal the global batch size")
        total = sum(r.shard_fraction for r in ranks)
        if abs(total - 1.0) > _SUM_TOLERANCE:
            raise ValueError(f"shard_fraction: the ranks' fractions sum to {total:.9f}, must be 1 "
                             f"(limit +- {_SUM_TOLERANCE}). Fix: normalise the fractions")

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def shard_fractions(self) -> tuple[float, ...]:
        return tuple(r.shard_fraction for r in self.ranks)

    @property
    def samples_per_rank(self) -> tuple[int, ...]:
        return tuple(r.samples for r in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": SHARDED_PLAN_FORMAT, "version": SHARDED_PLAN_VERSION,
            "global_batch_size": self.global_batch_size,
            "ranks": [{"rank": r.rank, "island": r.island, "device_type": r.device_type,
                       "micro_batch_size": r.micro_batch_size, "num_micro_batches": r.num_micro_batches,
                       "shard_fraction": r.shard_fraction, "recompute": r.recompute} for r in self.ranks],
        }
        if self.predicted is not None:
            out["predicted"] = dict(self.predicted)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardedPlan:
        if data.get("format") != SHARDED_PLAN_FORMAT:
            raise ValueError(f"format: expected {SHARDED_PLAN_FORMAT!r} (got {data.get('format')!r}). "
                             "Fix: pass a file written by ShardedPlan.to_json")
        if data.get("version") != SHARDED_PLAN_VERSION:
            raise ValueError(f"version: this code reads version {SHARDED_PLAN_VERSION} (got {data.get('version')!r}). "
                             "Fix: re-plan with this version of megatron-het")
        ranks = tuple(RankShare(rank=r["rank"], island=r["island"], device_type=r["device_type"],
                                micro_batch_size=r["micro_batch_size"], num_micro_batches=r["num_micro_batches"],
                                shard_fraction=float(r["shard_fraction"]), recompute=bool(r.get("recompute", False)))
                      for r in data["ranks"])
        return cls(ranks=ranks, global_batch_size=data["global_batch_size"], predicted=data.get("predicted"))

    @classmethod
    def from_json(cls, text: str) -> ShardedPlan:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write JSON atomically (temp file in the same directory, fsync, os.replace), as Plan.save does."""
        from megatron_het.utils.atomic import write_text_atomic

        write_text_atomic(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ShardedPlan:
        plan = load_any_plan(path)
        if not isinstance(plan, ShardedPlan):
            raise PlanError(file=str(path), field="format", value=plan.to_dict()["format"],
                            problem=f"a pipeline plan, not a sharded one ({SHARDED_PLAN_FORMAT!r})",
                            fix="load it with Plan.load or load_any_plan")
        return plan


def load_any_plan(path: str | os.PathLike[str]) -> Plan | ShardedPlan:
    """A pipeline Plan or a ShardedPlan, chosen by the file's ``"format"`` key."""
    from megatron_het.plan.types import PLAN_FORMAT, Plan

    source = str(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise PlanError(file=source, field="(file)", value=source, problem=f"cannot read: {e.strerror}",
                        fix="check the path") from e
    except json.JSONDecodeError as e:
        raise PlanError(file=source, field=f"line {e.lineno} column {e.colno}", value=e.msg,
                        problem="invalid JSON", fix="correct the JSON syntax") from e
    fmt = data.get("format") if isinstance(data, dict) else None
    if fmt == PLAN_FORMAT:
        return Plan.from_dict(data, source=source)
    if fmt == SHARDED_PLAN_FORMAT:
        try:
            return ShardedPlan.from_dict(data)
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(file=source, field="ranks" if isinstance(e, (KeyError, TypeError)) else "(plan)",
                            value=str(e), problem="not a valid sharded plan",
                            fix="re-plan with tools/plan.py --mode sharded") from e
    raise PlanError(file=source, field="format", value=fmt,
                    problem=f"unknown plan format (this build reads {PLAN_FORMAT!r} and {SHARDED_PLAN_FORMAT!r})",
                    fix="pass a file written by tools/plan.py (Plan.save or ShardedPlan.save)")


def validate_sharded_plan(plan: ShardedPlan, cluster: ClusterSpec) -> None:
    """Raise PlanError unless every rank names an island of ``cluster`` with its device type, and no
    island gets more ranks than it has GPUs."""
    used: dict[str, int] = {}
    for r in plan.ranks:
        if r.island not in cluster.island_names:
            raise PlanError(field=f"ranks[{r.rank}].island", value=r.island, problem="no such island in the cluster",
                            fix=f"use one of {list(cluster.island_names)} or re-plan for this cluster")
        device = cluster.island(r.island).device.name
        if r.device_type != device:
            raise PlanError(field=f"ranks[{r.rank}].device_type", value=r.device_type,
                            problem=f"island {r.island!r} has {device} GPUs",
                            fix="re-plan for this cluster file")
        used[r.island] = used.get(r.island, 0) + 1
    for name, n in used.items():
        have = cluster.island(name).num_gpus
        if n > have:
            raise PlanError(field="ranks", value=n, problem=f"{n} ranks on island {name!r}, which has {have} GPUs "
                            f"(limit {have})", fix="re-plan for this cluster file")


def describe_sharded_plan(plan: ShardedPlan) -> list[str]:
    """Human lines: a header, one line per rank, the prediction (pretrain_gpt.py and tools/plan.py print these)."""
    lines = [f"plan: uneven sharded data parallelism, {plan.world_size} ranks, global batch {plan.global_batch_size}"]
    for r in plan.ranks:
        lines.append(f"  rank {r.rank}: {r.island}({r.device_type}) micro-batch {r.micro_batch_size} x "
                     f"{r.num_micro_batches}, state shard {100 * r.shard_fraction:.2f}%"
                     + (", recompute" if r.recompute else ""))
    if plan.predicted:
        p = plan.predicted
        lines.append(f"  predicted: {p.get('iteration_time_s', float('nan')) * 1000:.1f} ms/iteration, "
                     f"{p.get('tokens_per_s', float('nan')):.0f} tokens/s")
    return lines
