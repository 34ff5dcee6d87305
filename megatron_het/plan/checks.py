"""Semantic checks of a pipeline plan's parts against a model and a cluster.

The checks take the plan's fields rather than the Plan itself, so ``Plan.validate`` (types.py) can
call them without this module importing the type back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_het.plan.errors import PlanError
from megatron_het.plan.stage import ReplicaPlan
from megatron_het.schedule.generators import SCHEDULE_NAMES

if TYPE_CHECKING:
    from megatron_het.cluster import ClusterSpec, ModelSpec

__all__ = ["check_cluster", "check_pipeline", "check_schedule", "check_tp_comm_overlap", "check_tp_grid",
           "tp_grid_divisors"]

Replicas = Sequence[ReplicaPlan]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_batch(replicas: Replicas, micro_batch_size: int, global_batch_size: int) -> None:
    if micro_batch_size < 1:
        raise PlanError(field="micro_batch_size", value=micro_batch_size,
                        problem="must be >= 1", fix="set micro_batch_size to 1 or more")
    for ri, r in enumerate(replicas):
        if r.num_micro_batches < 1:
            raise PlanError(
                field=f"replicas[{ri}].num_micro_batches", value=r.num_micro_batches,
                problem="every replica needs at least 1 micro-batch (minimum 1)",
                fix="give the replica at least 1 micro-batch, or remove the replica",
            )
    total = sum(r.num_micro_batches for r in replicas)
    if global_batch_size != micro_batch_size * total:
        raise PlanError(
            field="global_batch_size", value=global_batch_size,
            problem=f"must equal micro_batch_size * sum(num_micro_batches) = {micro_batch_size} * "
            f"{total} = {micro_batch_size * total}, but is {global_batch_size}",
            fix=f"set global_batch_size to {micro_batch_size * total} or change the replicas' "
            "num_micro_batches",
        )


def _check_chunk_layers(replicas: Replicas, vp: int, num_layers: int) -> None:
    """Explicit chunk_layers: on every stage or none, V chunks each, covering [0, L) in virtual-stage order."""
    for ri, r in enumerate(replicas):
        given = [bool(st.chunk_layers) for st in r.stages]
        if not any(given):
            for si, st in enumerate(r.stages):
                if st.num_layers % vp:
                    raise PlanError(
                        field=f"replicas[{ri}].stages[{si}].layers", value=list(st.layers),
                        problem=f"{st.num_layers} layers do not split into virtual_pipeline_size={vp} "
                        "equal chunks",
                        fix=f"give this stage a multiple of {vp} layers, or list its chunk_layers",
                    )
            continue
        if not all(given):
            si = given.index(False)
            raise PlanError(field=f"replicas[{ri}].stages[{si}].chunk_layers", value=[],
                            problem="chunk_layers are listed on some stages of the replica but not on this one",
                            fix="list chunk_layers on every stage of the replica, or on none")
        expect = 0
        for c in range(vp):
            for si, st in enumerate(r.stages):
                path = f"replicas[{ri}].stages[{si}].chunk_layers"
                if len(st.chunk_layers) != vp:
                    raise PlanError(field=path, value=[list(x) for x in st.chunk_layers],
                                    problem=f"{len(st.chunk_layers)} chunks listed, virtual_pipeline_size is {vp}",
                                    fix=f"list exactly {vp} [first, stop) ranges")
                first, stop = st.chunk_layers[c]
                if first != expect or stop <= first:
                    raise PlanError(
                        field=f"{path}[{c}]", value=[first, stop],
                        problem=f"virtual stage {c * len(r.stages) + si} (chunk {c} of stage {si}) must start at "
                        f"layer {expect} and hold >= 1 layer, got [{first}, {stop})",
                        fix="chunks cover the model in virtual-stage order: chunk 0 of every stage, then chunk 1, ...",
                    )
                expect = stop
        if expect != num_layers:
            raise PlanError(field=f"replicas[{ri}].stages[{len(r.stages) - 1}].chunk_layers", value=expect,
                            problem=f"the chunks stop at layer {expect}, the model has num_layers={num_layers}",
                            fix=f"end the last stage's last chunk at {num_layers}")
        for si, st in enumerate(r.stages):
            n = sum(b - a for a, b in st.chunk_layers)
            if n != st.num_layers:
                raise PlanError(field=f"replicas[{ri}].stages[{si}].chunk_layers", value=n,
                                problem=f"the chunks hold {n} layers, the stage's layers {list(st.layers)} say "
                                f"{st.num_layers}", fix=f"make layers span {n} layers, or fix the chunks")


def check_schedule(replicas: Replicas, schedule: str, vp: int, num_layers: int) -> None:
    """The schedule and virtual size must be one the runtime runs (RUNTIME_SCHEDULES): never run as another."""
    if schedule not in SCHEDULE_NAMES:
        raise PlanError(field="schedule", value=schedule, problem="unknown schedule name",
                        fix="use one of " + ", ".join(SCHEDULE_NAMES))
    if schedule == "interleaved":
        if vp < 2:
            raise PlanError(field="virtual_pipeline_size", value=vp,
                            problem="the interleaved schedule needs at least 2 model chunks per stage",
                            fix='set virtual_pipeline_size >= 2, or use schedule "1f1b"')
        for ri, r in enumerate(replicas):
            p = len(r.stages)
            if p < 2:
                raise PlanError(
                    field=f"replicas[{ri}].stages", value=p,
                    problem=f"the runtime runs interleaved (virtual_pipeline_size={vp}) only with >= 2 stages per "
                    f"replica, this replica has {p} (as megatron-core)",
                    fix='use schedule "1f1b" with virtual_pipeline_size 1 for one-stage replicas')
            if r.num_micro_batches % p:
                raise PlanError(
                    field=f"replicas[{ri}].num_micro_batches", value=r.num_micro_batches,
                    problem=f"the interleaved schedule needs a multiple of the replica's {p} stages",
                    fix=f"use a multiple of {p} micro-batches for this replica",
                )
        _check_chunk_layers(replicas, vp, num_layers)
    else:
        if vp != 1:
            raise PlanError(
                field="virtual_pipeline_size", value=vp,
                problem=f"schedule {schedule!r} runs 1 model chunk per stage, not {vp} (the runtime implements "
                f"virtual_pipeline_size > 1 for 'interleaved' only)",
                fix='set virtual_pipeline_size to 1, or use schedule "interleaved"',
            )
        for ri, r in enumerate(replicas):
            for si, st in enumerate(r.stages):
                if st.chunk_layers:
                    raise PlanError(field=f"replicas[{ri}].stages[{si}].chunk_layers",
                                    value=[list(x) for x in st.chunk_layers],
                                    problem=f"model chunks need schedule 'interleaved', the plan has {schedule!r}",
                                    fix='remove chunk_layers, or use schedule "interleaved"')


def _check_ranks(replicas: Replicas) -> None:
    where: dict[int, str] = {}
    for ri, r in enumerate(replicas):
        if not r.stages:
            raise PlanError(field=f"replicas[{ri}].stages", value=[], problem="a replica needs >= 1 stage",
                            fix="add a stage or remove the replica")
        for si, s in enumerate(r.stages):
            path = f"replicas[{ri}].stages[{si}].ranks"
            if not s.ranks:
                raise PlanError(field=path, value=list(s.ranks), problem="a stage needs >= 1 rank",
                                fix="list the stage's tensor-parallel ranks")
            for rank in s.ranks:
                if rank in where:
                    raise PlanError(
                        field=path, value=list(s.ranks),
                        problem=f"rank {rank} is used twice (also in {where[rank]})",
                        fix="give every rank exactly one place in the plan",
                    )
                where[rank] = path
    n = len(where)
    wrong = sorted(r for r in where if not 0 <= r < n)
    if wrong:
        missing = sorted(set(range(n)) - where.keys())
        raise PlanError(
            field=where[wrong[0]], value=wrong[0],
            problem=f"ranks must be exactly 0..{n - 1} for the {n} ranks placed; rank {wrong[0]} is out "
            f"of range and {missing} are unused",
            fix="renumber the ranks so they run 0..world_size-1 without gaps",
        )


def _check_layers(replicas: Replicas, num_layers: int) -> None:
    for ri, r in enumerate(replicas):
        expect = 0
        for si, s in enumerate(r.stages):
            path = f"replicas[{ri}].stages[{si}].layers"
            first, stop = s.layers
            if first != expect:
                problem = (f"starts at layer {first} but the previous stage stopped at {expect}"
                           if si else f"the first stage must start at layer 0, not {first}")
                raise PlanError(
                    field=path, value=list(s.layers),
                    problem=problem + (" (layers missing)" if first > expect else " (layers overlap)"),
                    fix=f"make the stages cover [0, {num_layers}) contiguously: start this one at {expect}",
                )
            if stop <= first:
                raise PlanError(
                    field=path, value=list(s.layers),
                    problem=f"a stage needs at least 1 layer ([first, stop) with stop > first; got "
                    f"{stop - first} layers)",
                    fix="give the stage at least one layer or remove it",
                )
            expect = stop
        if expect != num_layers:
            raise PlanError(
                field=f"replicas[{ri}].stages[{len(r.stages) - 1}].layers",
                value=list(r.stages[-1].layers),
                problem=f"the last stage stops at layer {expect} but the model has num_layers={num_layers}",
                fix=f"end the last stage's range at {num_layers}",
            )


def _check_tp(replicas: Replicas, model: ModelSpec, sequence_parallel: bool,
              expert_tensor_parallel: int | None = None) -> None:
    sizes = (
        ("num_attention_heads", model.num_attention_heads),
        ("num_query_groups", model.num_query_groups),
        ("ffn_hidden_size", model.ffn_hidden_size),
        # the shared expert is tensor-parallel over the stage's ranks like the dense MLP
        *((("moe_shared_expert_intermediate_size", model.moe_shared_expert_intermediate_size),)
          if model.moe_shared_expert_intermediate_size else ()),
    )
    for ri, r in enumerate(replicas):
        for si, s in enumerate(r.stages):
            if s.tp_grid is not None:
                check_tp_grid(s.tp_grid, len(s.ranks), model, f"replicas[{ri}].stages[{si}]")
                if s.tp_comm_overlap:
                    raise PlanError(
                        field=f"replicas[{ri}].stages[{si}].tp_comm_overlap", value=True,
                        problem="a 3D tensor-parallel stage (tp_grid) overlaps its own collectives; "
                        "tp_comm_overlap is the 1D sequence-parallel overlap",
                        fix='remove "tp_comm_overlap" from this stage, or remove "tp_grid"',
                    )
                continue
            for name, size in sizes:
                if size % s.tp:
                    raise PlanError(
                        field=f"replicas[{ri}].stages[{si}].ranks", value=list(s.ranks),
                        problem=f"tensor-parallel size {s.tp} (number of ranks) does not divide "
                        f"{name}={size}",
                        fix=f"use a TP size that divides {size}: one of {_divisors(size)[:12]}",
                    )
            etp = expert_tensor_parallel or s.tp  # routed experts split over expert-TP (default: the stage's TP)
            if model.is_moe and model.moe_ffn_hidden_size % etp:
                raise PlanError(
                    field=f"replicas[{ri}].stages[{si}].ranks", value=list(s.ranks),
                    problem=f"expert tensor-parallel size {etp} does not divide moe_ffn_hidden_size="
                    f"{model.moe_ffn_hidden_size}",
                    fix=f"use an expert-TP size that divides {model.moe_ffn_hidden_size}: one of "
                        f"{_divisors(model.moe_ffn_hidden_size)[:12]}",
                )
            if model.is_moe and s.tp > 1 and not sequence_parallel:
                # megatron-core's MoELayer raises at the first training forward (moe_layer.py:629)
                raise PlanError(
                    field="sequence_parallel", value=False,
                    problem=f"replicas[{ri}].stages[{si}] runs MoE layers with tensor parallelism ({s.tp} ranks); "
                    "megatron-core's MoE layers train under TP only with sequence parallelism",
                    fix='set "sequence_parallel": true (--sequence-parallel), or use TP 1 on this stage',
                )
            if sequence_parallel and model.seq_length % s.tp:
                raise PlanError(
                    field=f"replicas[{ri}].stages[{si}].ranks", value=list(s.ranks),
                    problem=f"sequence_parallel needs TP size {s.tp} to divide seq_length={model.seq_length}",
                    fix="use a TP size that divides seq_length, or turn sequence_parallel off",
                )


def check_experts(replicas: Replicas, model: ModelSpec, ep: int, etp: int | None) -> None:
    """Expert parallelism (plan/experts.py): an MoE model, experts dividing over EP, expert domains of
    identical replicas (their MoE layers meet in the same order: same stages, layers, TP sizes,
    model chunks and micro-batches)."""
    from megatron_het.plan.experts import expert_domains

    if ep < 1 or (etp is not None and etp < 1):
        raise PlanError(field="expert_parallel", value=(ep, etp), problem="sizes must be >= 1",
                        fix="use expert_parallel >= 1 and expert_tensor_parallel >= 1 (or leave it out)")
    if model.is_moe and model.add_bias_linear:
        # megatron-core takes expert biases only at expert-TP 1 (transformer_config.py:2279), and there
        # without expert parallelism its SequentialMLP adds the bias in place on a view (mlp.py:354)
        tps = sorted({etp or s.tp for r in replicas for s in r.stages})
        if ep == 1 or tps != [1]:
            raise PlanError(field="expert_parallel", value=ep,
                            problem=f"the model's experts have linear biases (add_bias_linear), which megatron-core "
                            f"trains only with expert parallelism and expert-TP 1 (got EP {ep}, expert-TP {tps})",
                            fix="add --disable-bias-linear (as Mixtral and Megatron-LM's MoE examples), or use EP > 1 "
                                "with --expert-tensor-parallel-size 1")
    if ep == 1 and etp is None:
        return
    if not model.is_moe:
        raise PlanError(field="expert_parallel", value=ep, problem="the model has no experts (num_experts unset)",
                        fix="remove expert_parallel / expert_tensor_parallel, or plan an MoE model")
    if model.num_experts % ep:
        raise PlanError(field="expert_parallel", value=ep,
                        problem=f"does not divide num_experts={model.num_experts}",
                        fix=f"use one of {_divisors(model.num_experts)}")
    k = expert_domains(len(replicas), [[s.tp for s in r.stages] for r in replicas], ep=ep, etp=etp)
    for first in range(0, len(replicas), k):
        shape = None
        for ri in range(first, first + k):
            r = replicas[ri]
            # recomputation re-runs a layer's all-to-alls inside the backward: it must match too
            this = (r.num_micro_batches, [(s.layers, s.tp, s.chunk_layers, s.tp_grid, s.recompute,
                                           s.recompute_num_layers) for s in r.stages])
            if shape is not None and this != shape:
                raise PlanError(
                    field=f"replicas[{ri}]", value=f"{r.num_micro_batches} micro-batches, {len(r.stages)} stages",
                    problem=f"replicas {first}..{first + k - 1} share their experts (expert_parallel {ep}) but differ "
                    "in stages, layers, TP sizes, recomputation or micro-batches (their MoE layers must meet in the same "
                    "order)",
                    fix=f"give replicas {first}..{first + k - 1} the same structure and micro-batches, or a smaller "
                        "expert_parallel")
            shape = this


def tp_grid_divisors(grid: Sequence[int], model: ModelSpec) -> list[tuple[str, int, str, int]]:
    """(model size name, size, what must divide it, its value) for a 3D grid ``(gx, gy, gz)``.

    AxoNN's layout (tp/linear3d.py): the QKV and FC1 GEMMs split input features over x and output
    features over y, each weight block sharded over z along its output features; the projection and
    FC2 GEMMs are transposed (input over y, output over x, sharded over z). Attention heads and
    key/value groups follow the QKV output block, so they split over y."""
    gx, gy, gz = grid
    qkv = (model.num_attention_heads + 2 * model.num_query_groups) * model.kv_channels
    return [("hidden_size", model.hidden_size, "gx*gz", gx * gz),
            ("ffn_hidden_size", model.ffn_hidden_size, "gy*gz", gy * gz),
            ("num_attention_heads", model.num_attention_heads, "gy", gy),
            ("num_query_groups", model.num_query_groups, "gy", gy),
            ("qkv width", qkv, "gy*gz", gy * gz)]


def tp3d_unsupported(model: ModelSpec) -> str | None:
    """Why the 3D layers (model/tp3d.py) cannot build ``model``, or None: they are GPT-2's recipe
    (LayerNorm, learned positions, biases, GeLU) without dropout."""
    if model.swiglu:
        return "the gated (SwiGLU) MLP's fused [gate; up] weight has no 3D tensor-parallel layout yet"
    if model.is_moe:
        return "mixture-of-experts layers have no 3D tensor-parallel layout"
    from megatron_het.cluster.model_spec import off_recipe

    off = off_recipe(model)
    if off:
        field, value = next(iter(off.items()))
        return f"the 3D layers build GPT-2's architecture only (got {field}={value!r})"
    if model.hidden_dropout or model.attention_dropout:
        return (f"the 3D layers run without dropout (got hidden_dropout={model.hidden_dropout}, "
                f"attention_dropout={model.attention_dropout})")
    return None


def check_tp_grid(grid: Sequence[int], ranks: int, model: ModelSpec, path: str) -> None:
    """A stage's ``tp_grid``: the product is its rank count and the grid divides the layer's sizes."""
    gx, gy, gz = grid
    if gx * gy * gz != ranks:
        raise PlanError(
            field=f"{path}.tp_grid", value=list(grid),
            problem=f"the grid's product gx*gy*gz = {gx * gy * gz} must equal the stage's {ranks} ranks",
            fix=f"choose axis sizes whose product is {ranks}, or list {gx * gy * gz} ranks",
        )
    unsupported = tp3d_unsupported(model)
    if unsupported:
        raise PlanError(field=f"{path}.tp_grid", value=list(grid), problem=unsupported,
                        fix='remove "tp_grid" (1D tensor parallelism) for this model')
    for name, size, what, div in tp_grid_divisors(grid, model):
        if size % div:
            raise PlanError(
                field=f"{path}.tp_grid", value=list(grid),
                problem=f"{what} = {div} does not divide {name}={size}",
                fix=f"choose a grid whose {what} divides {size}: one of {_divisors(size)[:12]}",
            )


def check_tp_comm_overlap(replicas: Replicas, sequence_parallel: bool) -> None:
    """``tp_comm_overlap`` chunks the all-gather/reduce-scatter of sequence parallelism: it needs it."""
    if sequence_parallel:
        return
    for ri, r in enumerate(replicas):
        for si, s in enumerate(r.stages):
            if s.tp_comm_overlap:
                raise PlanError(
                    field=f"replicas[{ri}].stages[{si}].tp_comm_overlap", value=True,
                    problem="the chunked TP overlap splits sequence parallelism's all-gather/reduce-scatter, "
                    "but the plan has sequence_parallel false",
                    fix='set "sequence_parallel": true in the plan, or "tp_comm_overlap": false on this stage',
                )


def check_cluster(replicas: Replicas, cluster: ClusterSpec) -> None:
    islands = {i.name: i for i in cluster.islands}
    used: dict[str, int] = {}
    for ri, r in enumerate(replicas):
        for si, s in enumerate(r.stages):
            path = f"replicas[{ri}].stages[{si}]"
            island = islands.get(s.island)
            if island is None:
                raise PlanError(
                    field=f"{path}.island", value=s.island,
                    problem="no island of that name in the cluster"
                    + (f" {cluster.source}" if cluster.source else ""),
                    fix="use one of " + ", ".join(sorted(islands)),
                )
            if s.device_type != island.device.name:
                raise PlanError(
                    field=f"{path}.device_type", value=s.device_type,
                    problem=f"island {s.island!r} has device type {island.device.name!r}",
                    fix=f'set "device_type": "{island.device.name}"',
                )
            used[s.island] = used.get(s.island, 0) + s.tp
    for name, count in used.items():
        if count > islands[name].num_gpus:
            raise PlanError(
                field="replicas", value={name: count},
                problem=f"the plan places {count} ranks on island {name!r}, which has only "
                f"{islands[name].num_gpus} GPUs",
                fix=f"place at most {islands[name].num_gpus} ranks on {name!r}",
            )


def _check_recompute(replicas: Replicas) -> None:
    """recompute_num_layers (Megatron's block method) needs recompute on and at most the stage's layers."""
    for ri, r in enumerate(replicas):
        for si, st in enumerate(r.stages):
            n, path = st.recompute_num_layers, f"replicas[{ri}].stages[{si}].recompute_num_layers"
            if n < 0:
                raise PlanError(field=path, value=n, problem="must be >= 0 (0: every layer recomputes)",
                                fix="write how many of each chunk's first layers recompute, or 0 for all")
            if n and not st.recompute:
                raise PlanError(field=path, value=n, problem="is set but the stage's recompute is false",
                                fix='set "recompute": true on this stage, or remove recompute_num_layers')
            if n > st.num_layers:
                raise PlanError(field=path, value=n,
                                problem=f"exceeds the stage's {st.num_layers} layers ({list(st.layers)})",
                                fix=f"use 1..{st.num_layers}, or 0 to recompute every layer")


def check_pipeline(*, replicas: Replicas, micro_batch_size: int, global_batch_size: int, schedule: str,
                   virtual_pipeline_size: int, sequence_parallel: bool, model: ModelSpec,
                   cluster: ClusterSpec | None, expert_parallel: int = 1,
                   expert_tensor_parallel: int | None = None) -> None:
    """Raise PlanError for the first problem found (the cluster checks only when one is given)."""
    if not replicas:
        raise PlanError(field="replicas", value=[], problem="a plan needs >= 1 replica", fix="add a replica")
    _check_ranks(replicas)
    _check_layers(replicas, model.num_layers)
    _check_batch(replicas, micro_batch_size, global_batch_size)
    check_schedule(replicas, schedule, virtual_pipeline_size, model.num_layers)
    _check_tp(replicas, model, sequence_parallel, expert_tensor_parallel)
    check_experts(replicas, model, expert_parallel, expert_tensor_parallel)
    _check_recompute(replicas)
    check_tp_comm_overlap(replicas, sequence_parallel)
    if cluster is not None:
        check_cluster(replicas, cluster)
