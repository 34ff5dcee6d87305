"""What each rank holds of every full parameter (``grad_sync.Holding``): from its built stage, or for
a whole plan without processes.

``stage_holdings`` is the one definition of a rank's holdings from its stage's parameters (by global
name, ``global_params``); the trainer (``HeteroTrainer.holdings``) calls it on its built model.
``plan_holdings`` calls it for every rank of a plan, on the same megatron-core model the trainer
builds (``stage_model_spec``, ``chunk_model_specs``, ``build_gpt_stage``/``build_tp3d_gpt_stage``),
built on the meta device with placeholder groups that only answer their size and this rank's place,
once per distinct stage shape: a 768-rank plan of three shapes costs a handful of builds. So the
gradient synchronizer's buckets of any plan (``grad_sync.plan_buckets``) are computable in one
process, e.g. to check a large plan's group creation on a fake world (tests/dryrun).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence

import torch

from megatron_het.checkpoint.full_state import TIED_OUTPUT, WORD_EMBEDDING, global_name
from megatron_het.checkpoint.tp_layout import is_glu
from megatron_het.cluster import ModelSpec
from megatron_het.model.gpt import StageModelSpec
from megatron_het.perf.flops import padded_vocab_size
from megatron_het.plan import Plan, StagePlan, chunk_layers, rank_roles
from megatron_het.plan.experts import ExpertLayout
from megatron_het.plan.types import fused_attention
from megatron_het.runtime.grad_sync import Holding
from megatron_het.runtime.stage_groups import SELF_GROUPS, STAGE_WIDE_GROUPS, plan_expert_layouts_of
from megatron_het.runtime.tp3d_groups import tp3d_holdings

__all__ = ["chunk_model_specs", "global_params", "plan_holdings", "plan_padded_vocab", "stage_holdings",
           "stage_model_spec"]


def plan_padded_vocab(model: ModelSpec, plan: Plan) -> int:
    """One padded vocabulary for every stage: a multiple of 128 x every TP size in the plan."""
    lcm = 1
    for replica in plan.replicas:
        for stage in replica.stages:
            lcm = math.lcm(lcm, stage.tp)
    return padded_vocab_size(model.vocab_size, tp=lcm)


def stage_model_spec(model: ModelSpec, plan: Plan, stage: StagePlan, *, is_first: bool, is_last: bool,
                     vocab_size: int, params_dtype: torch.dtype = torch.float32,
                     transformer_impl: str | None = None, deterministic: bool = False) -> StageModelSpec:
    """What a stage of ``plan`` builds. A 3D stage (``tp_grid``) runs megatron-core at TP = gy without
    sequence parallelism (z splits the batch, model/tp3d_stage.py)."""
    spec = StageModelSpec(model=model, num_layers=stage.layers[1] - stage.layers[0], layer_offset=stage.layers[0],
                          tp=stage.tp, pre_process=is_first, post_process=is_last, vocab_size=vocab_size,
                          recompute=stage.recompute, recompute_num_layers=stage.recompute_num_layers,
                          sequence_parallel=plan.sequence_parallel, params_dtype=params_dtype,
                          transformer_impl=transformer_impl, deterministic=deterministic,
                          fused_attention=fused_attention(plan.attention), ep=plan.expert_parallel,
                          etp=plan.expert_tensor_parallel)
    if stage.tp_grid is not None:
        spec = dataclasses.replace(spec, tp=stage.tp_grid[1], sequence_parallel=False)
    return spec


def chunk_model_specs(spec: StageModelSpec, chunk_ranges: Sequence[tuple[int, int]]) -> list[StageModelSpec]:
    """One spec per model chunk (virtual pipeline): chunk c holds ``chunk_ranges[c]``; only the first
    chunk of a first stage has the embedding, only the last chunk of a last stage the output layer."""
    if len(chunk_ranges) == 1:
        return [spec]
    last = len(chunk_ranges) - 1
    return [dataclasses.replace(spec, num_layers=stop - first, layer_offset=first,
                                pre_process=spec.pre_process and c == 0, post_process=spec.post_process and c == last)
            for c, (first, stop) in enumerate(chunk_ranges)]


def global_params(chunks: Sequence[tuple[torch.nn.Module, int]], *, tied: bool,
                  first_expert: int = 0) -> dict[str, torch.nn.Parameter]:
    """A stage's parameters by global name (checkpoint/full_state.py), from (chunk, its first global
    layer) pairs in chunk order; a tied output layer is the word embedding (the last stage's copy).
    ``first_expert``: global index of the rank's first routed expert (expert parallelism)."""
    out = {}
    for gpt, first in chunks:
        for name, p in gpt.named_parameters():
            g = global_name(name, first, first_expert)
            out[WORD_EMBEDDING if tied and g == TIED_OUTPUT else g] = p
    return out


def stage_holdings(params: Mapping[str, torch.Tensor], *, rank: int, stage_key: tuple[int, int], tp_rank: int,
                   tp_size: int, gated: bool, grid: tuple[int, int, int] | None = None,
                   experts: ExpertLayout | None = None) -> list[Holding]:
    """What rank ``rank`` holds of each full parameter, from its stage's ``params`` (global name ->
    local tensor with megatron-core's TP attributes), in their order. A parameter marked
    ``sequence_parallel`` holds a TP-partial gradient (sequence-parallel norms and biases; q/k norms
    under TP, model/gpt.py) where TP > 1. ``grid``: a 3D stage's (gx, gy, gz);
    ``tp_rank`` is then the rank's index in the grid (runtime/tp3d_groups.tp3d_holdings). ``experts``:
    the rank's expert grid place (a routed expert's weights split over expert-TP, not the stage's TP)."""
    dims = {n: int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None
            for n, p in params.items()}
    if grid is not None:
        return tp3d_holdings({n: (tuple(p.shape), dims[n]) for n, p in params.items()}, rank=rank,
                             grid_rank=tp_rank, stage_key=stage_key, grid=grid, gated=gated)
    hs = []
    for name, p in params.items():
        t_rank, t_size = (tp_rank, tp_size) if experts is None else experts.tp_coordinates(name, tp_rank, tp_size)
        full = list(p.shape)
        if dims[name] is not None:
            full[dims[name]] *= t_size
        hs.append(Holding(name=name, rank=rank, stage_key=stage_key, tp_rank=t_rank, tp_size=t_size,
                          partition_dim=dims[name], full_shape=tuple(full), glu=is_glu(name, gated),
                          sequence_parallel=tp_size > 1 and bool(getattr(p, "sequence_parallel", False))))
    return hs


# ---- every rank of a plan, without processes ----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Placeholder:
    """Stands for a process group while a stage is built: megatron-core reads only its size and
    this rank's place in it (``get_pg_size``/``get_pg_rank``); nothing is communicated."""

    n: int
    me: int

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.me


@contextlib.contextmanager
def _any_world() -> Iterator[None]:
    """megatron-core answers every group's size with 1 while no default group exists
    (``get_pg_size``), so a stage is built inside one: the caller's, else a one-rank gloo world in
    this process for the duration."""
    import torch.distributed as dist

    from megatron_het.platform import HOST_BACKEND

    if dist.is_initialized():
        yield
        return
    dist.init_process_group(HOST_BACKEND, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _build_meta(specs: Sequence[StageModelSpec], *, tp_rank: int, grid: tuple[int, int, int] | None,
                micro_batch_size: int, experts: ExpertLayout | None = None) -> list[torch.nn.Module]:
    """The stage's chunks as the trainer builds them (``PipelineStrategy._build_model``), on meta."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_het.model.gpt import build_gpt_stage, transformer_config
    from megatron_het.model.tp3d_stage import build_tp3d_gpt_stage
    from megatron_het.tp.grid import Grid4D
    from megatron_het.tp.groups import GridGroups

    grid_groups = None
    if grid is not None:
        g = Grid4D(x=grid[0], y=grid[1], z=grid[2])
        c = g.coords(tp_rank)
        grid_groups = GridGroups(grid=g, coords=c, x=_Placeholder(g.x, c["x"]), y=_Placeholder(g.y, c["y"]),
                                 z=_Placeholder(g.z, c["z"]), data=_Placeholder(1, 0))
        tp = grid_groups.y
    else:
        tp = _Placeholder(specs[0].tp, tp_rank)
    one = _Placeholder(1, 0)
    pgc = ProcessGroupCollection(**dict.fromkeys(STAGE_WIDE_GROUPS, tp), **dict.fromkeys(SELF_GROUPS, one))
    pgc.tp_ep = tp
    if experts is not None and (experts.ep > 1 or experts.etp != specs[0].tp):  # the stage's expert grid
        pgc.ep = _Placeholder(experts.ep, experts.ep_rank)
        pgc.expt_tp = _Placeholder(experts.etp, experts.etp_rank)
        pgc.tp_ep = pgc.tp_ep_pp = _Placeholder(experts.ep * experts.etp, experts.ep_rank * experts.etp + experts.etp_rank)
    out = []
    with _any_world(), torch.device("meta"):
        for spec in specs:
            if spec.model.is_moe:  # the alltoall dispatcher opens a CUDA stream when built; no dispatcher has
                # parameters, so the allgather one (nothing to open) builds the same ones
                spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model,
                                                                           moe_token_dispatcher_type="allgather"))
            # no initial values (shapes only): host path, no device RNG, no init kernels on meta
            config = transformer_config(spec, initialize=False)
            if grid_groups is not None:
                out.append(build_tp3d_gpt_stage(spec, config, pgc, grid_groups, micro_batch_size=micro_batch_size))
            else:
                out.append(build_gpt_stage(spec, config, pgc))
    return out


def plan_holdings(plan: Plan, model: ModelSpec, *, padded_vocab: int | None = None,
                  transformer_impl: str | None = None) -> list[Holding]:
    """Every rank's holdings, rank by rank, each rank's in its parameters' order: exactly the list
    ``GradientSynchronizer`` all-gathers from the ranks of a ``HeteroTrainer`` run of ``plan``.
    ``padded_vocab``/``transformer_impl``: as given to the trainer (None: ``plan_padded_vocab``; the
    trainer's layer-spec choice). Each distinct stage shape (layers, chunks, first/last, TP size and
    rank, 3D grid) is built once on the meta device."""
    vocab = padded_vocab or plan_padded_vocab(model, plan)
    tied = not model.untie_embeddings_and_output_weights
    layouts = plan_expert_layouts_of(plan, model.num_experts) if model.is_moe else {}
    built: dict[tuple, list[Holding]] = {}  # per stage shape: the holdings of its first rank
    out = []
    for rank, role in sorted(rank_roles(plan).items()):
        replica = plan.replicas[role.replica]
        stage = replica.stages[role.stage]
        spec = stage_model_spec(model, plan, stage, is_first=role.is_first_stage, is_last=role.is_last_stage,
                                vocab_size=vocab, transformer_impl=transformer_impl)
        ranges = chunk_layers(replica, plan.virtual_pipeline_size)[role.stage]
        experts = layouts.get(rank)
        key = (spec, tuple(ranges), role.tp_rank, stage.tp_grid, experts)
        stage_key = (role.replica, role.stage)
        if key not in built:
            chunks = _build_meta(chunk_model_specs(spec, ranges), tp_rank=role.tp_rank, grid=stage.tp_grid,
                                 micro_batch_size=plan.micro_batch_size, experts=experts)
            params = global_params(list(zip(chunks, (first for first, _ in ranges))), tied=tied,
                                   first_expert=experts.first_expert if experts else 0)
            built[key] = stage_holdings(params, rank=rank, stage_key=stage_key, tp_rank=role.tp_rank,
                                        tp_size=role.tp_size, gated=model.swiglu,
                                        grid=stage.tp_grid, experts=experts)
        # the same shape elsewhere holds the same pieces: only the rank and its stage differ (a copy of
        # the fields: dataclasses.replace costs 1 s more on 100,000 holdings)
        out += [Holding(**{**vars(h), "rank": rank, "stage_key": stage_key}) for h in built[key]]
    return out
