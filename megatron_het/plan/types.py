"""Plan data types: who runs which layers with which batch share (pure data, no validation here).

Semantic checks live in :mod:`megatron_het.plan.validate`; JSON in :mod:`megatron_het.plan.serialize`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PLAN_FORMAT = "megatron-het-plan"  # value of the "format" key in plan JSON
PLAN_FORMAT_VERSION = 1  # value of the "version" key this code reads and writes


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage: a tensor-parallel group on one island running a contiguous layer range."""

    island: str  # island name in the cluster file
    device_type: str  # catalog name of the island's device (checked against the cluster)
    ranks: tuple[int, ...]  # global ranks of this stage's tensor-parallel group, in TP-rank order
    # [first, stop) global 0-based transformer layer indices; the first stage of a replica also holds
    # the embedding, the last the output layer + loss. With virtual_pipeline_size > 1 this is the
    # stage's share in stage order; see layout.chunk_layers for the layers each model chunk holds.
    layers: tuple[int, int]
    recompute: bool = False  # full activation recomputation on this stage
    tp_comm_overlap: bool = False  # chunked collective/GEMM overlap in this stage's TP layers

    @property
    def tp(self) -> int:
        """Tensor-parallel size of this stage."""
        return len(self.ranks)

    @property
    def num_layers(self) -> int:
        """Number of transformer layers on this stage."""
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True, kw_only=True)
class ReplicaPlan:
    """One full pipeline; data parallelism is across replicas."""

    stages: tuple[StagePlan, ...]  # pipeline order
    num_micro_batches: int  # this replica's share of the global batch, in micro-batches

    @property
    def ranks(self) -> tuple[int, ...]:
        """All ranks of the replica, stage by stage, TP order inside a stage."""
        return tuple(r for stage in self.stages for r in stage.ranks)


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
    predicted: Mapping[str, object] | None = None  # performance-model output attached by the planner
    version: int = PLAN_FORMAT_VERSION  # JSON format version

    @property
    def world_size(self) -> int:
        """Number of distinct ranks; a valid plan uses exactly 0..world_size-1."""
        return len({r for replica in self.replicas for r in replica.ranks})

    def to_dict(self) -> dict:
        """JSON-ready dict (includes the format and version keys)."""
        from megatron_het.plan.serialize import plan_to_dict

        return plan_to_dict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, object], *, source: str | None = None) -> Plan:
        """Parse a dict produced by :meth:`to_dict` (or hand-written JSON); raises PlanError."""
        from megatron_het.plan.serialize import plan_from_dict

        return plan_from_dict(d, source=source)

    def to_json(self) -> str:
        """Pretty JSON text, stable key order, trailing newline."""
        from megatron_het.plan.serialize import plan_to_json

        return plan_to_json(self)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write JSON atomically (temp file in the same directory, fsync, os.replace)."""
        from megatron_het.plan.serialize import save_plan

        save_plan(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan JSON file; errors name the file and the field."""
        from megatron_het.plan.serialize import load_plan

        return load_plan(path)
