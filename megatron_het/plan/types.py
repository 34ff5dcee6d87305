"""The pipeline plan: replicas of stages, the batch split and schedule choices (plain data).

A ``Plan`` is built freely (the planner makes candidates) and checked by ``validate``
(plan/checks.py). It implements the plan interface (plan/interface.py); its stages and replicas are
in plan/stage.py, JSON text and files in plan/jsonio.py, either-kind loading in plan/serialize.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_het.plan.checks import check_pipeline
from megatron_het.plan.errors import PlanError
from megatron_het.plan.fields import as_bool, as_int, as_list, as_str, check_keys, required
from megatron_het.plan.jsonio import json_text, read_json, write_json
from megatron_het.plan.stage import ReplicaPlan, StagePlan

if TYPE_CHECKING:
    from megatron_het.cluster import ClusterSpec, ModelSpec
    from megatron_het.plan.interface import MemoryCheck

__all__ = ["DEFAULT_PRECISION", "PLAN_ATTENTIONS", "PLAN_FORMAT", "PLAN_FORMAT_VERSION", "PLAN_PRECISIONS", "TRAINS_IN",
           "Plan", "ReplicaPlan", "StagePlan", "fused_attention"]

PLAN_FORMAT = "megatron-het-plan"  # value of the "format" key in plan JSON
PLAN_FORMAT_VERSION = 1  # value of the "version" key this code reads and writes

_PLAN_KEYS = ("format", "version", "micro_batch_size", "global_batch_size", "schedule", "virtual_pipeline_size",
              "sequence_parallel", "use_distributed_optimizer", "overlap_grad_reduce", "precision", "attention",
              "expert_parallel", "expert_tensor_parallel", "replicas", "predicted")
# Attention kernels a plan may record: "fused" (flash / memory-efficient: transformer-engine, or torch's
# SDPA in the local spec; no s x s scores held) or "unfused" (megatron-core's DotProductAttention).
PLAN_ATTENTIONS = ("fused", "unfused")


def fused_attention(attention: str | None) -> bool | None:
    """A plan's attention record as the flag the model and the predictor take (None: the device decides)."""
    return None if attention is None else attention == "fused"


def _check_attention(attention: str | None, source: str | None) -> None:
    if attention is not None and attention not in PLAN_ATTENTIONS:
        raise PlanError(file=source, field="attention", value=attention, problem="unknown attention kernel",
                        fix=f"use one of: {', '.join(PLAN_ATTENTIONS)} (or leave it out: fused on GPUs)")
# Precisions a plan may record (megatron_het.cluster.catalog.PRECISIONS, repeated here so plan/ does
# not import cluster/ at run time).
PLAN_PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp8")
DEFAULT_PRECISION = "bf16"  # what every plan written before the field existed was priced as
# Plan precision -> the dtype its layers train in on this runtime (tf32: fp32 storage, TF32 matmuls where
# the hardware has them; fp8 plans are priced but not run). runtime/plan_record.py trains in it and a
# measured profile prices only plans of its own (perf.profile.check_profile_precision).
TRAINS_IN = {"fp32": "fp32", "tf32": "fp32", "bf16": "bf16", "fp16": "fp16"}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Replicas, batch split and schedule choices for one training run."""

    replicas: tuple[ReplicaPlan, ...]  # data-parallel replicas, each a full pipeline
    micro_batch_size: int  # sequences per micro-batch (same on every replica)
    global_batch_size: int  # must equal micro_batch_size * sum(r.num_micro_batches)
    schedule: str = "1f1b"  # pipeline schedule name, one of megatron_het.schedule.SCHEDULE_NAMES
    virtual_pipeline_size: int = 1  # model chunks per stage for "interleaved"
    sequence_parallel: bool = False  # Megatron sequence parallelism inside TP groups
    use_distributed_optimizer: bool = False  # shard optimizer state across replicas
    # reduce gradient buckets during each stage's last backward (the runtime's --overlap-grad-reduce;
    # with the distributed optimizer also the updated weights' gather during the next forward,
    # --overlap-param-gather); absent from older plans: False
    overlap_grad_reduce: bool = False
    # Training precision the plan was priced for (Megatron: no flag = fp32, --fp16, --bf16, --fp8-format;
    # tf32 = fp32 storage with tensor-core matmuls). Absent from older plan files, which were priced as bf16.
    precision: str = DEFAULT_PRECISION
    # The attention kernel the plan was priced with and runs (PLAN_ATTENTIONS); None: fused on GPU
    # device types, unfused on host ones (what every plan written before the field was priced with)
    attention: str | None = None
    # MoE models: routed experts spread over EP ranks, each expert's weights over expert-TP ranks
    # (None: each stage's TP size), megatron-core's expert grid over an expert domain of
    # EP x ETP / TP identical replicas (plan/experts.py). Written only when set
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None
    predicted: Mapping[str, object] | None = None  # performance-model output attached by the planner
    version: int = PLAN_FORMAT_VERSION  # JSON format version

    @property
    def world_size(self) -> int:
        """Number of distinct ranks; a valid plan uses exactly 0..world_size-1."""
        return len({r for replica in self.replicas for r in replica.ranks})

    def island_ranks(self) -> dict[str, tuple[int, ...]]:
        """Island name -> its ranks (ascending), islands in the order the plan first uses them."""
        by_island: dict[str, list[int]] = {}
        for replica in self.replicas:
            for stage in replica.stages:
                by_island.setdefault(stage.island, []).extend(stage.ranks)
        return {name: tuple(sorted(ranks)) for name, ranks in by_island.items()}

    def validate(self, model: ModelSpec, cluster: ClusterSpec | None = None, *,
                 memory_check: MemoryCheck | None = None) -> None:
        """Raise PlanError for the first problem found; the memory check, when given, runs last."""
        _check_attention(self.attention, None)
        check_pipeline(replicas=self.replicas, micro_batch_size=self.micro_batch_size,
                       global_batch_size=self.global_batch_size, schedule=self.schedule,
                       virtual_pipeline_size=self.virtual_pipeline_size, sequence_parallel=self.sequence_parallel,
                       model=model, cluster=cluster, expert_parallel=self.expert_parallel,
                       expert_tensor_parallel=self.expert_tensor_parallel)
        if memory_check is not None:
            memory_check(self, model, cluster)

    def describe(self) -> list[str]:
        """A header, one line per replica (its stages), the prediction when there is one."""
        lines = [f"plan: {len(self.replicas)} replica(s), {self.world_size} ranks, micro-batch "
                 f"{self.micro_batch_size}, global batch {self.global_batch_size}, schedule {self.schedule}"]
        for r, replica in enumerate(self.replicas):
            stages = " | ".join(f"{s.island}({s.device_type}) TP={s.tp} ranks {s.ranks[0]}-{s.ranks[-1]} "
                                f"layers {s.layers[0]}-{s.layers[1] - 1}" for s in replica.stages)
            lines.append(f"  replica {r}: {replica.num_micro_batches} micro-batches: {stages}")
        if self.predicted:
            p = self.predicted
            lines.append(f"  predicted: {p.get('iteration_time_s', float('nan')) * 1000:.1f} ms/iteration, "
                         f"{p.get('tokens_per_s', float('nan')):.0f} tokens/s")
        return lines

    def to_dict(self) -> dict:
        """JSON-ready dict, the format and version keys first."""
        predicted = None
        if self.predicted is not None:
            # Deep copy through JSON: proves it is serializable and detaches it from the plan.
            predicted = json.loads(json.dumps(dict(self.predicted)))
        return {
            "format": PLAN_FORMAT, "version": self.version, "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.global_batch_size, "schedule": self.schedule,
            "virtual_pipeline_size": self.virtual_pipeline_size, "sequence_parallel": self.sequence_parallel,
            "use_distributed_optimizer": self.use_distributed_optimizer,
            # written only when on, so plans without it keep their files byte for byte
            **({"overlap_grad_reduce": True} if self.overlap_grad_reduce else {}), "precision": self.precision,
            **({"attention": self.attention} if self.attention is not None else {}),
            **({"expert_parallel": self.expert_parallel} if self.expert_parallel != 1 else {}),
            **({"expert_tensor_parallel": self.expert_tensor_parallel} if self.expert_tensor_parallel is not None
               else {}),
            "replicas": [r.to_dict() for r in self.replicas], "predicted": predicted,
        }

    def to_json(self) -> str:
        """Pretty JSON text, stable key order, integer lists on one line, trailing newline."""
        return json_text(self.to_dict())

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write JSON atomically (utils/atomic.py)."""
        write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, d: object, *, source: str | None = None) -> Plan:
        """Parse a dict produced by :meth:`to_dict` (or hand-written JSON); PlanError names the key path."""
        d = check_keys(d, "", _PLAN_KEYS, source)
        fmt = required(d, "format", "", source)
        if fmt != PLAN_FORMAT:
            raise PlanError(file=source, field="format", value=fmt, problem="not a megatron-het plan",
                            fix=f'set "format": "{PLAN_FORMAT}"')
        version = as_int(required(d, "version", "", source), "version", source)
        if version != PLAN_FORMAT_VERSION:
            raise PlanError(
                file=source, field="version", value=version,
                problem=f"unsupported plan format version {version} (this megatron-het reads version "
                f"{PLAN_FORMAT_VERSION})",
                fix="regenerate the plan with this megatron-het version, or set "
                f'"version": {PLAN_FORMAT_VERSION} if it follows docs/plan-format.md',
            )
        replicas = as_list(required(d, "replicas", "", source), "replicas", source, what="replicas")
        precision = as_str(d.get("precision", DEFAULT_PRECISION), "precision", source)
        if precision not in PLAN_PRECISIONS:
            raise PlanError(file=source, field="precision", value=precision, problem="unknown precision",
                            fix=f"use one of: {', '.join(PLAN_PRECISIONS)}")
        attention = d.get("attention")
        if attention is not None:
            attention = as_str(attention, "attention", source)
            _check_attention(attention, source)
        predicted = d.get("predicted")
        if predicted is not None and not isinstance(predicted, Mapping):
            raise PlanError(file=source, field="predicted", value=predicted,
                            problem="expected a JSON object or null", fix="write {...} or null")
        return cls(
            replicas=tuple(ReplicaPlan.from_dict(r, f"replicas[{i}]", source) for i, r in enumerate(replicas)),
            micro_batch_size=as_int(required(d, "micro_batch_size", "", source), "micro_batch_size", source),
            global_batch_size=as_int(required(d, "global_batch_size", "", source), "global_batch_size", source),
            schedule=as_str(d.get("schedule", "1f1b"), "schedule", source),
            virtual_pipeline_size=as_int(d.get("virtual_pipeline_size", 1), "virtual_pipeline_size", source),
            sequence_parallel=as_bool(d.get("sequence_parallel", False), "sequence_parallel", source),
            use_distributed_optimizer=as_bool(d.get("use_distributed_optimizer", False),
                                              "use_distributed_optimizer", source),
            overlap_grad_reduce=as_bool(d.get("overlap_grad_reduce", False), "overlap_grad_reduce", source),
            precision=precision,
            attention=attention,
            expert_parallel=as_int(d.get("expert_parallel", 1), "expert_parallel", source),
            expert_tensor_parallel=(None if d.get("expert_tensor_parallel") is None
                                    else as_int(d["expert_tensor_parallel"], "expert_tensor_parallel", source)),
            predicted=dict(predicted) if predicted is not None else None,
            version=version,
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a pipeline plan JSON file; errors name the file and the field (either kind: load_any_plan)."""
        return cls.from_dict(read_json(path), source=str(path))
