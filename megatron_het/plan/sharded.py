"""ShardedPlan: one data-parallel group whose ranks differ in batch share and state share (Cephalo).

Every rank runs the whole model (TP=1, PP=1) on its own micro-batches; the training state
(fp32 master weights, gradients after reduction, Adam moments) is split into uneven contiguous
shards. Compute share follows speed (``micro_batch_size x num_micro_batches``), state share follows
free memory (``shard_fraction``). Self-checking data (PlanError) implementing the plan interface
(plan/interface.py); the sharded runtime (sharding/) and the planner read it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_het.plan.errors import PlanError
from megatron_het.plan.fields import as_bool, as_fraction, as_int, as_list, as_str, check_keys, required
from megatron_het.plan.jsonio import json_text, read_json, write_json
from megatron_het.plan.types import PLAN_FORMAT, PLAN_PRECISIONS

if TYPE_CHECKING:
    from megatron_het.cluster import ClusterSpec, ModelSpec
    from megatron_het.plan.interface import MemoryCheck

__all__ = ["SHARDED_PLAN_FORMAT", "SHARDED_PLAN_VERSION", "RankShare", "ShardedPlan"]

SHARDED_PLAN_FORMAT = "megatron-het-sharded-plan"  # "format" key of the JSON
SHARDED_PLAN_VERSION = 1  # "version" key this code reads and writes
_SUM_TOLERANCE = 1e-6  # shard fractions must sum to 1 within this
_PLAN_KEYS = ("format", "version", "global_batch_size", "precision", "ranks", "predicted")
_RANK_KEYS = ("rank", "island", "device_type", "micro_batch_size", "num_micro_batches", "shard_fraction",
              "recompute")


def _is_int(value: object, minimum: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= minimum


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
        if not _is_int(self.rank, 0):
            raise PlanError(field="rank", value=self.rank, problem="must be an integer >= 0",
                            fix="number ranks from 0")
        if not _is_int(self.micro_batch_size, 1):
            raise PlanError(field=f"{where}.micro_batch_size", value=self.micro_batch_size,
                            problem="must be an integer >= 1", fix="give every rank a positive micro-batch size")
        if not _is_int(self.num_micro_batches, 0):
            raise PlanError(field=f"{where}.num_micro_batches", value=self.num_micro_batches,
                            problem="must be an integer >= 0", fix="pass 0 for a state-only rank")
        as_fraction(self.shard_fraction, f"{where}.shard_fraction", None)

    @property
    def samples(self) -> int:
        """Samples of the global batch this rank computes per iteration."""
        return self.micro_batch_size * self.num_micro_batches

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "island": self.island, "device_type": self.device_type,
                "micro_batch_size": self.micro_batch_size, "num_micro_batches": self.num_micro_batches,
                "shard_fraction": self.shard_fraction, "recompute": self.recompute}

    @classmethod
    def from_dict(cls, d: object, path: str, source: str | None) -> RankShare:
        d = check_keys(d, path, _RANK_KEYS, source)
        return cls(rank=as_int(required(d, "rank", path, source), f"{path}.rank", source),
                   island=as_str(required(d, "island", path, source), f"{path}.island", source),
                   device_type=as_str(required(d, "device_type", path, source), f"{path}.device_type", source),
                   micro_batch_size=as_int(required(d, "micro_batch_size", path, source),
                                           f"{path}.micro_batch_size", source),
                   num_micro_batches=as_int(required(d, "num_micro_batches", path, source),
                                            f"{path}.num_micro_batches", source),
                   shard_fraction=as_fraction(required(d, "shard_fraction", path, source),
                                              f"{path}.shard_fraction", source),
                   recompute=as_bool(d.get("recompute", False), f"{path}.recompute", source))


@dataclass(frozen=True, kw_only=True)
class ShardedPlan:
    """Per-rank batch shares and state shares of one uneven sharded data-parallel group."""

    ranks: tuple[RankShare, ...]  # in rank order, ranks[i].rank == i
    global_batch_size: int  # samples per optimizer step; == sum of the ranks' samples
    # Training precision the plan was priced for, as Plan.precision; pretrain_gpt.py trains in it
    # (runtime/plan_record.py). None (files and plans from before the field): not recorded, the run's
    # flags decide as they always did, and it is priced as the sharded mode priced then ("mixed")
    precision: str | None = None
    predicted: Mapping[str, Any] | None = field(default=None, compare=False)  # perf-model figures, if priced

    def __post_init__(self) -> None:
        ranks = tuple(self.ranks)
        object.__setattr__(self, "ranks", ranks)
        if self.precision is not None and self.precision not in PLAN_PRECISIONS:
            raise PlanError(field="precision", value=self.precision, problem="unknown precision",
                            fix=f"use one of {', '.join(PLAN_PRECISIONS)}")
        if not ranks:
            raise PlanError(field="ranks", value=[], problem="a sharded plan needs at least one rank",
                            fix="add a RankShare per GPU")
        for i, r in enumerate(ranks):
            if not isinstance(r, RankShare):
                raise PlanError(field=f"ranks[{i}]", value=type(r).__name__, problem="must be a RankShare",
                                fix="build RankShare objects")
            if r.rank != i:
                raise PlanError(field=f"ranks[{i}].rank", value=r.rank, problem=f"must equal its position {i}",
                                fix="list ranks in order 0..N-1")
        samples = sum(r.samples for r in ranks)
        if samples != self.global_batch_size:
            raise PlanError(field="global_batch_size", value=self.global_batch_size,
                            problem=f"the ranks compute {samples} samples per iteration, not global_batch_size",
                            fix="make the sum of micro_batch_size x num_micro_batches equal the global batch size")
        total = sum(r.shard_fraction for r in ranks)
        if abs(total - 1.0) > _SUM_TOLERANCE:
            raise PlanError(field="shard_fraction", value=total,
                            problem=f"the ranks' fractions sum to {total:.9f}, must be 1 (limit +- {_SUM_TOLERANCE})",
                            fix="normalise the fractions")

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def shard_fractions(self) -> tuple[float, ...]:
        return tuple(r.shard_fraction for r in self.ranks)

    @property
    def samples_per_rank(self) -> tuple[int, ...]:
        return tuple(r.samples for r in self.ranks)

    def island_ranks(self) -> dict[str, tuple[int, ...]]:
        """Island name -> its ranks (ascending), islands in the order the ranks first use them."""
        by_island: dict[str, list[int]] = {}
        for r in self.ranks:
            by_island.setdefault(r.island, []).append(r.rank)
        return {name: tuple(ranks) for name, ranks in by_island.items()}

    def validate(self, model: ModelSpec, cluster: ClusterSpec | None = None, *,
                 memory_check: MemoryCheck | None = None) -> None:
        """Shares are checked on construction; here every rank must name an island of ``cluster`` with
        its device type, and no island may get more ranks than it has GPUs. Every rank runs the whole
        ``model``, so the model constrains only memory (``memory_check``)."""
        if cluster is not None:
            self._check_cluster(cluster)
        if memory_check is not None:
            memory_check(self, model, cluster)

    def _check_cluster(self, cluster: ClusterSpec) -> None:
        used: dict[str, int] = {}
        for r in self.ranks:
            if r.island not in cluster.island_names:
                raise PlanError(field=f"ranks[{r.rank}].island", value=r.island,
                                problem="no such island in the cluster",
                                fix=f"use one of {list(cluster.island_names)} or re-plan for this cluster")
            device = cluster.island(r.island).device.name
            if r.device_type != device:
                raise PlanError(field=f"ranks[{r.rank}].device_type", value=r.device_type,
                                problem=f"island {r.island!r} has {device} GPUs", fix="re-plan for this cluster file")
            used[r.island] = used.get(r.island, 0) + 1
        for name, n in used.items():
            have = cluster.island(name).num_gpus
            if n > have:
                raise PlanError(field="ranks", value=n, problem=f"{n} ranks on island {name!r}, which has "
                                f"{have} GPUs (limit {have})", fix="re-plan for this cluster file")

    def describe(self) -> list[str]:
        """A header, one line per rank, the prediction (pretrain_gpt.py and tools/plan.py print these)."""
        lines = [f"plan: uneven sharded data parallelism, {self.world_size} ranks, global batch "
                 f"{self.global_batch_size}" + (f", precision {self.precision}" if self.precision else "")]
        for r in self.ranks:
            lines.append(f"  rank {r.rank}: {r.island}({r.device_type}) micro-batch {r.micro_batch_size} x "
                         f"{r.num_micro_batches}, state shard {100 * r.shard_fraction:.2f}%"
                         + (", recompute" if r.recompute else ""))
        if self.predicted:
            p = self.predicted
            lines.append(f"  predicted: {p.get('iteration_time_s', float('nan')) * 1000:.1f} ms/iteration, "
                         f"{p.get('tokens_per_s', float('nan')):.0f} tokens/s")
        return lines

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": SHARDED_PLAN_FORMAT, "version": SHARDED_PLAN_VERSION,
                               "global_batch_size": self.global_batch_size,
                               **({"precision": self.precision} if self.precision else {}),
                               "ranks": [r.to_dict() for r in self.ranks]}
        if self.predicted is not None:
            out["predicted"] = dict(self.predicted)
        return out

    def to_json(self) -> str:
        return json_text(self.to_dict())

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write JSON atomically (utils/atomic.py), as Plan.save does."""
        write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: object, *, source: str | None = None) -> ShardedPlan:
        """Parse a dict produced by :meth:`to_dict`; PlanError names the file, key path and fix."""
        fmt = data.get("format") if isinstance(data, Mapping) else None
        if fmt == PLAN_FORMAT:
            raise PlanError(file=source, field="format", value=fmt,
                            problem=f"a pipeline plan, not a sharded one ({SHARDED_PLAN_FORMAT!r})",
                            fix="load it with Plan.load or load_any_plan")
        d = check_keys(data, "", _PLAN_KEYS, source)
        if required(d, "format", "", source) != SHARDED_PLAN_FORMAT:
            raise PlanError(file=source, field="format", value=fmt, problem="not a megatron-het sharded plan",
                            fix=f'set "format": "{SHARDED_PLAN_FORMAT}"')
        version = required(d, "version", "", source)
        if version != SHARDED_PLAN_VERSION:
            raise PlanError(file=source, field="version", value=version,
                            problem=f"this megatron-het reads sharded plan version {SHARDED_PLAN_VERSION}",
                            fix="re-plan with this version of megatron-het (tools/plan.py --mode sharded)")
        ranks = as_list(required(d, "ranks", "", source), "ranks", source, what="ranks")
        predicted = d.get("predicted")
        if predicted is not None and not isinstance(predicted, Mapping):
            raise PlanError(file=source, field="predicted", value=predicted,
                            problem="expected a JSON object or null", fix="write {...} or null")
        try:
            return cls(ranks=tuple(RankShare.from_dict(r, f"ranks[{i}]", source) for i, r in enumerate(ranks)),
                       global_batch_size=as_int(required(d, "global_batch_size", "", source), "global_batch_size",
                                                source),
                       precision=(as_str(d["precision"], "precision", source) if d.get("precision") is not None
                                  else None),
                       predicted=predicted)
        except PlanError as e:
            raise e.with_file(source) from None

    @classmethod
    def from_json(cls, text: str) -> ShardedPlan:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ShardedPlan:
        """Read a sharded plan JSON file (either kind: load_any_plan)."""
        return cls.from_dict(read_json(path), source=str(path))
