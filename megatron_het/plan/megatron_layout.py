"""The plan Megatron-LM's parallelism flags describe, laid over a heterogeneous cluster's islands.

A Megatron-LM script says ``--tensor-model-parallel-size T --pipeline-model-parallel-size P`` and
lets the data-parallel size follow from the world size. That is one homogeneous layout: DP equal
replicas of P stages of T ranks, ranks in megatron-core's order (``homogeneous_plan``). Here each
stage runs on the island its ranks fall on (ranks are numbered island by island in cluster-file
order), so replicas may cross islands; a tensor-parallel group may not (it needs one device type
and one fast link). Pure: no torch, no process groups.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_het.plan.errors import PlanError
from megatron_het.plan.layout import homogeneous_plan
from megatron_het.plan.types import Plan, ReplicaPlan

if TYPE_CHECKING:  # plan/ does not import cluster/ at run time
    from megatron_het.cluster import ClusterSpec, ModelSpec


@dataclass(frozen=True, kw_only=True)
class LayoutFlags:
    """Megatron-LM's layout flags as given (None: not given)."""

    tensor_model_parallel_size: int = 1  # --tensor-model-parallel-size
    pipeline_model_parallel_size: int = 1  # --pipeline-model-parallel-size
    # --virtual-pipeline-model-parallel-size, or num_layers / P / --num-layers-per-virtual-pipeline-stage
    virtual_pipeline_size: int = 1
    decoder_first_pipeline_num_layers: int | None = None  # layers of the first stage (uneven split)
    decoder_last_pipeline_num_layers: int | None = None  # layers of the last stage
    recompute: bool = False  # --recompute-granularity full
    recompute_num_layers: int = 0  # --recompute-method block --recompute-num-layers N; 0: uniform


def stage_layer_counts(num_layers: int, pp: int, *, first: int | None, last: int | None) -> list[int]:
    """Layers per stage as Megatron-LM splits them: the first/last stage take the given counts, the
    other stages share the rest evenly (which must divide)."""
    fixed = {0: first, pp - 1: last} if pp > 1 else {0: first if first is not None else last}
    counts: list[int | None] = [fixed.get(i) for i in range(pp)]
    rest = num_layers - sum(c for c in counts if c is not None)
    free = counts.count(None)
    if free == 0 and rest != 0 or free and (rest < free or rest % free):
        given = ", ".join(f"{n} {v}" for n, v in (("--decoder-first-pipeline-num-layers", first),
                                                   ("--decoder-last-pipeline-num-layers", last)) if v is not None)
        raise PlanError(field="--num-layers", value=num_layers,
                        problem=f"{num_layers} layers do not split evenly over {pp} pipeline stages"
                                + (f" with {given}" if given else ""),
                        fix="choose a --pipeline-model-parallel-size that divides the layers left to share, or set "
                            "--decoder-first/last-pipeline-num-layers")
    return [c if c is not None else rest // free for c in counts]


def plan_from_layout_flags(model: ModelSpec, cluster: ClusterSpec, flags: LayoutFlags, *, micro_batch_size: int,
                           global_batch_size: int) -> Plan:
    """The homogeneous plan of ``flags`` over every rank of ``cluster``; PlanError naming the flag when
    the world does not factor, or a TP group would span two islands."""
    tp, pp, vpp = flags.tensor_model_parallel_size, flags.pipeline_model_parallel_size, flags.virtual_pipeline_size
    world = cluster.num_gpus
    if world % (tp * pp):
        raise PlanError(field="--tensor-model-parallel-size x --pipeline-model-parallel-size", value=tp * pp,
                        problem=f"{tp} x {pp} does not divide the cluster's {world} ranks",
                        fix=f"choose sizes whose product divides {world}")
    dp = world // (tp * pp)
    counts = stage_layer_counts(model.num_layers, pp, first=flags.decoder_first_pipeline_num_layers,
                                last=flags.decoder_last_pipeline_num_layers)
    plan = homogeneous_plan(tp=tp, pp=pp, dp=dp, num_layers=model.num_layers, micro_batch_size=micro_batch_size,
                            global_batch_size=global_batch_size, layers_per_stage=counts)
    owner: list[tuple[str, str]] = []  # rank -> (island, device type)
    for island in cluster.islands:
        owner += [(island.name, island.device.name)] * island.num_gpus
    replicas = []
    for r, replica in enumerate(plan.replicas):
        stages = []
        for s, stage in enumerate(replica.stages):
            islands = sorted({owner[rank][0] for rank in stage.ranks})
            if len(islands) > 1:
                sizes = ", ".join(f"{i.name} {i.num_gpus}" for i in cluster.islands)
                raise PlanError(field="--tensor-model-parallel-size", value=tp,
                                problem=f"stage {s} of replica {r} (ranks {list(stage.ranks)}) would span islands "
                                        f"{' and '.join(islands)}; a tensor-parallel group needs one device type",
                                fix=f"choose a size that divides each island's GPUs ({sizes}), or drop the layout "
                                    "flags and let the planner choose")
            stages.append(dataclasses.replace(stage, island=owner[stage.ranks[0]][0],
                                              device_type=owner[stage.ranks[0]][1], recompute=flags.recompute,
                                              recompute_num_layers=flags.recompute_num_layers))
        replicas.append(ReplicaPlan(stages=tuple(stages), num_micro_batches=replica.num_micro_batches))
    return dataclasses.replace(plan, replicas=tuple(replicas), virtual_pipeline_size=vpp,
                               schedule="interleaved" if vpp > 1 else plan.schedule)
