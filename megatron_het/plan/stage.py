"""The parts of a pipeline plan: stages and replicas (pure data and their JSON shape)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_het.plan.errors import PlanError
from megatron_het.plan.fields import as_bool, as_int, as_int_list, as_list, as_str, check_keys, required

__all__ = ["ReplicaPlan", "StagePlan"]

_REPLICA_KEYS = ("num_micro_batches", "stages")
_STAGE_KEYS = ("island", "device_type", "ranks", "layers", "recompute", "recompute_num_layers", "tp_comm_overlap",
               "tp_grid", "chunk_layers")


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
    # With recompute: 0 recomputes every layer (Megatron's --recompute-method uniform, one layer per
    # unit); N > 0 only the first N layers of each of the stage's model chunks (--recompute-method block
    # --recompute-num-layers N), so a stage short of memory pays for no more recomputation than it needs.
    # Written to JSON only when given.
    recompute_num_layers: int = 0
    tp_comm_overlap: bool = False  # chunked collective/GEMM overlap in this stage's TP layers
    # AxoNN 3D tensor parallelism instead of 1D: (gx, gy, gz) axis sizes of the stage's grid
    # (tp/grid.Grid4D: x splits input features, y output features, z tokens and the weight shards),
    # product = len(ranks), ranks in grid order (x fastest). None: Megatron's 1D TP over the ranks.
    tp_grid: tuple[int, int, int] | None = None
    # With virtual_pipeline_size V > 1: the [first, stop) global layers of each of the stage's V model
    # chunks, chunk order (uneven where device speeds differ; their sizes sum to num_layers). Empty:
    # Megatron's even split (layout.chunk_layers). Written to JSON only when given.
    chunk_layers: tuple[tuple[int, int], ...] = ()

    @property
    def tp(self) -> int:
        """Tensor-parallel size of this stage."""
        return len(self.ranks)

    @property
    def num_layers(self) -> int:
        """Number of transformer layers on this stage."""
        return self.layers[1] - self.layers[0]

    def recomputed_layers(self, virtual_pipeline_size: int = 1) -> int:
        """How many of the stage's layers recompute their forward in the backward (every model chunk
        of Megatron's even split holds ``num_layers / virtual_pipeline_size`` unless ``chunk_layers``
        lists them)."""
        if not self.recompute:
            return 0
        if not self.recompute_num_layers:
            return self.num_layers
        sizes = ([b - a for a, b in self.chunk_layers] if self.chunk_layers
                 else [self.num_layers // virtual_pipeline_size] * virtual_pipeline_size)
        return sum(min(self.recompute_num_layers, n) for n in sizes)

    def to_dict(self) -> dict:
        """JSON-ready dict (every field, defaults included)."""
        out = {"island": self.island, "device_type": self.device_type, "ranks": list(self.ranks),
               "layers": list(self.layers), "recompute": self.recompute, "tp_comm_overlap": self.tp_comm_overlap}
        if self.recompute_num_layers:
            out["recompute_num_layers"] = self.recompute_num_layers
        if self.tp_grid is not None:  # written only when set: 1D plans keep their JSON unchanged
            out["tp_grid"] = list(self.tp_grid)
        if self.chunk_layers:
            out["chunk_layers"] = [list(c) for c in self.chunk_layers]
        return out

    @classmethod
    def from_dict(cls, d: object, path: str, source: str | None) -> StagePlan:
        """Parse the stage at key path ``path`` of file ``source``; raises PlanError."""
        d = check_keys(d, path, _STAGE_KEYS, source)
        layers = as_int_list(required(d, "layers", path, source), f"{path}.layers", source)
        if len(layers) != 2:
            raise PlanError(
                file=source, field=f"{path}.layers", value=list(layers),
                problem=f"expected 2 numbers [first, stop), found {len(layers)}",
                fix="write the layer range as [first, stop), e.g. [0, 4]",
            )
        tp_grid = None
        if d.get("tp_grid") is not None:
            grid = as_int_list(d["tp_grid"], f"{path}.tp_grid", source)
            if len(grid) != 3 or min(grid) < 1:
                raise PlanError(
                    file=source, field=f"{path}.tp_grid", value=list(grid),
                    problem=f"expected 3 axis sizes >= 1 [gx, gy, gz], found {len(grid)} number(s)",
                    fix="write the 3D tensor-parallel grid as [gx, gy, gz], e.g. [2, 2, 1], or remove the key",
                )
            tp_grid = (grid[0], grid[1], grid[2])
        chunks = []
        given = d.get("chunk_layers")
        for ci, c in enumerate(as_list(given, f"{path}.chunk_layers", source, what="chunks") if given is not None else []):
            rng = as_int_list(c, f"{path}.chunk_layers[{ci}]", source)
            if len(rng) != 2:
                raise PlanError(file=source, field=f"{path}.chunk_layers[{ci}]", value=list(rng),
                                problem=f"expected 2 numbers [first, stop), found {len(rng)}",
                                fix="write each chunk's layer range as [first, stop), e.g. [0, 2]")
            chunks.append((rng[0], rng[1]))
        return cls(
            chunk_layers=tuple(chunks),
            island=as_str(required(d, "island", path, source), f"{path}.island", source),
            device_type=as_str(required(d, "device_type", path, source), f"{path}.device_type", source),
            ranks=as_int_list(required(d, "ranks", path, source), f"{path}.ranks", source),
            layers=(layers[0], layers[1]),
            recompute=as_bool(d.get("recompute", False), f"{path}.recompute", source),
            recompute_num_layers=as_int(d.get("recompute_num_layers", 0), f"{path}.recompute_num_layers", source),
            tp_comm_overlap=as_bool(d.get("tp_comm_overlap", False), f"{path}.tp_comm_overlap", source),
            tp_grid=tp_grid,
        )


@dataclass(frozen=True, kw_only=True)
class ReplicaPlan:
    """One full pipeline; data parallelism is across replicas."""

    stages: tuple[StagePlan, ...]  # pipeline order
    num_micro_batches: int  # this replica's share of the global batch, in micro-batches

    @property
    def ranks(self) -> tuple[int, ...]:
        """All ranks of the replica, stage by stage, TP order inside a stage."""
        return tuple(r for stage in self.stages for r in stage.ranks)

    def to_dict(self) -> dict:
        return {"num_micro_batches": self.num_micro_batches, "stages": [s.to_dict() for s in self.stages]}

    @classmethod
    def from_dict(cls, d: object, path: str, source: str | None) -> ReplicaPlan:
        d = check_keys(d, path, _REPLICA_KEYS, source)
        stages = as_list(required(d, "stages", path, source), f"{path}.stages", source, what="stages")
        return cls(
            stages=tuple(StagePlan.from_dict(s, f"{path}.stages[{i}]", source) for i, s in enumerate(stages)),
            num_micro_batches=as_int(required(d, "num_micro_batches", path, source),
                                     f"{path}.num_micro_batches", source),
        )
