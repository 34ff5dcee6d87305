"""Rank layout: pure functions from a plan to where each rank sits, and plan builders."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_het.plan.errors import PlanError
from megatron_het.plan.types import Plan, ReplicaPlan, StagePlan


@dataclass(frozen=True, kw_only=True)
class RankRole:
    """Where one rank sits in a plan."""

    rank: int  # global rank
    replica: int  # index of its replica (data-parallel index)
    stage: int  # pipeline stage index inside the replica
    num_stages: int  # number of stages in that replica
    tp_rank: int  # position inside the stage's tensor-parallel group
    tp_size: int  # size of that group
    layers: tuple[int, int]  # the stage's [first, stop) layer range
    island: str  # island the stage runs on
    device_type: str  # catalog name of the island's device

    @property
    def is_first_stage(self) -> bool:
        """Holds the embedding."""
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        """Holds the output layer and loss."""
        return self.stage == self.num_stages - 1


def rank_roles(plan: Plan) -> dict[int, RankRole]:
    """Map every rank of the plan to its role; raises PlanError if a rank is placed twice."""
    roles: dict[int, RankRole] = {}
    for ri, replica in enumerate(plan.replicas):
        for si, stage in enumerate(replica.stages):
            for ti, rank in enumerate(stage.ranks):
                if rank in roles:
                    first = roles[rank]
                    raise PlanError(
                        field=f"replicas[{ri}].stages[{si}].ranks[{ti}]", value=rank,
                        problem=f"rank {rank} is already used by replicas[{first.replica}]"
                        f".stages[{first.stage}]",
                        fix="give every rank exactly one place in the plan",
                    )
                roles[rank] = RankRole(
                    rank=rank, replica=ri, stage=si, num_stages=len(replica.stages), tp_rank=ti,
                    tp_size=len(stage.ranks), layers=stage.layers, island=stage.island,
                    device_type=stage.device_type,
                )
    return dict(sorted(roles.items()))


def role_of(plan: Plan, rank: int) -> RankRole:
    """Role of one rank; raises PlanError when the plan does not place it."""
    roles = rank_roles(plan)
    if rank not in roles:
        raise PlanError(
            field="rank", value=rank,
            problem=f"rank {rank} is not in the plan (it places {len(roles)} ranks: "
            f"{min(roles, default=0)}..{max(roles, default=-1)})",
            fix=f"launch exactly {len(roles)} processes (world size {plan.world_size}) for this plan",
        )
    return roles[rank]


def layer_split(num_layers: int, weights: Sequence[float]) -> tuple[tuple[int, int], ...]:
    """Contiguous [first, stop) ranges covering num_layers, sized in proportion to weights.

    Every range gets at least one layer. Rounding is largest-remainder with ties going to the
    earlier index, so the result is deterministic.
    """
    n = len(weights)
    if n < 1:
        raise PlanError(field="weights", value=list(weights), problem="no stages to split layers over",
                        fix="pass one weight per stage")
    if n > num_layers:
        raise PlanError(
            field="weights", value=list(weights),
            problem=f"{n} stages need at least {n} layers but num_layers is {num_layers}",
            fix=f"use at most {num_layers} stages",
        )
    for i, w in enumerate(weights):
        if not (isinstance(w, int | float) and math.isfinite(w) and w > 0):
            raise PlanError(field=f"weights[{i}]", value=w, problem="weight must be a finite number > 0",
                            fix="use a positive relative speed, e.g. 1.0")
    total = float(sum(weights))
    ideal = [num_layers * w / total for w in weights]
    counts = [max(1, math.floor(x)) for x in ideal]
    # Give out missing layers where the ideal share is most under-served, take back extra layers
    # (never below 1) where it is most over-served.
    while sum(counts) < num_layers:
        i = max(range(n), key=lambda k: (ideal[k] - counts[k], -k))
        counts[i] += 1
    while sum(counts) > num_layers:
        i = min((k for k in range(n) if counts[k] > 1), key=lambda k: (ideal[k] - counts[k], k))
        counts[i] -= 1
    ranges, first = [], 0
    for c in counts:
        ranges.append((first, first + c))
        first += c
    return tuple(ranges)


def chunk_layers(
    replica: ReplicaPlan, virtual_pipeline_size: int
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per stage, per model chunk, the [first, stop) layers it holds (Megatron's interleaved order).

    A stage's explicit ``chunk_layers`` (uneven chunks, the planner's choice on mixed devices) are
    taken as given. Otherwise chunk c covers layers [c*L/V, (c+1)*L/V) of the L-layer model (V =
    virtual_pipeline_size), shared across the stages in pipeline order, stage s taking
    num_layers(s)/V of them. With V=1 this is each stage's own range. The even split needs every
    stage's layer count divisible by V.
    """
    v = virtual_pipeline_size
    if v == 1:
        return tuple((s.layers,) for s in replica.stages)
    if all(s.chunk_layers for s in replica.stages):
        return tuple(tuple(s.chunk_layers) for s in replica.stages)
    counts = [s.num_layers for s in replica.stages]
    for si, c in enumerate(counts):
        if v < 1 or c % v:
            raise PlanError(
                field=f"stages[{si}].layers", value=list(replica.stages[si].layers),
                problem=f"{c} layers cannot be split into virtual_pipeline_size={v} equal chunks",
                fix=f"give each stage a multiple of {v} layers, or list its chunk_layers",
            )
    per_chunk = sum(counts) // v
    first_layer = replica.stages[0].layers[0]
    out = []
    for si, c in enumerate(counts):
        offset = sum(counts[:si]) // v
        out.append(
            tuple(
                (first_layer + ci * per_chunk + offset, first_layer + ci * per_chunk + offset + c // v)
                for ci in range(v)
            )
        )
    return tuple(out)


def uneven_chunk_layers(stage_chunk_counts: Sequence[Sequence[int]]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per stage, per chunk, [first, stop) from layer counts ``[stage][chunk]`` laid out in virtual-stage
    order (chunk 0 of every stage, then chunk 1, ...): the explicit ``chunk_layers`` of a plan."""
    p = len(stage_chunk_counts)
    v = len(stage_chunk_counts[0]) if p else 0
    out: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    first = 0
    for c in range(v):
        for s in range(p):
            n = stage_chunk_counts[s][c]
            out[s].append((first, first + n))
            first += n
    return tuple(tuple(x) for x in out)


def homogeneous_plan(
    *,
    tp: int,
    pp: int,
    dp: int,
    num_layers: int,
    micro_batch_size: int,
    global_batch_size: int,
    island: str = "cpu",
    device_type: str = "CPU",
    layers_per_stage: Sequence[int] | None = None,
) -> Plan:
    """Megatron-style plan: dp equal replicas of pp stages of tp ranks.

    Rank order matches megatron-core's RankGenerator with order "tp-cp-ep-dp-pp" (cp = ep = 1):
    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank.
    """
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("micro_batch_size", micro_batch_size)):
        if value < 1:
            raise PlanError(field=name, value=value, problem=f"{name} must be >= 1",
                            fix=f"set {name} to 1 or more")
    per_replica = micro_batch_size * dp
    if global_batch_size < per_replica or global_batch_size % per_replica:
        raise PlanError(
            field="global_batch_size", value=global_batch_size,
            problem=f"must be a positive multiple of micro_batch_size * dp = {micro_batch_size} * {dp} "
            f"= {per_replica}",
            fix=f"use a multiple of {per_replica}, e.g. "
            f"{max(per_replica, global_batch_size // per_replica * per_replica)}",
        )
    if layers_per_stage is None:
        if num_layers % pp:
            raise PlanError(
                field="num_layers", value=num_layers,
                problem=f"{num_layers} layers do not split evenly over pp={pp} stages",
                fix="pass layers_per_stage, or use a pp that divides num_layers",
            )
        layers_per_stage = [num_layers // pp] * pp
    if len(layers_per_stage) != pp or sum(layers_per_stage) != num_layers or min(layers_per_stage) < 1:
        raise PlanError(
            field="layers_per_stage", value=list(layers_per_stage),
            problem=f"need {pp} counts, each >= 1, summing to num_layers={num_layers} "
            f"(got {len(layers_per_stage)} counts summing to {sum(layers_per_stage)})",
            fix="give one positive layer count per stage",
        )
    bounds = [0]
    for c in layers_per_stage:
        bounds.append(bounds[-1] + c)
    replicas = tuple(
        ReplicaPlan(
            stages=tuple(
                StagePlan(
                    island=island, device_type=device_type,
                    ranks=tuple(p * dp * tp + d * tp + t for t in range(tp)),
                    layers=(bounds[p], bounds[p + 1]),
                )
                for p in range(pp)
            ),
            num_micro_batches=global_batch_size // per_replica,
        )
        for d in range(dp)
    )
    return Plan(replicas=replicas, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size)
