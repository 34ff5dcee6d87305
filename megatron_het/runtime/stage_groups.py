"""Process groups for every stage of a plan, built explicitly (no ``parallel_state``).

Each stage is one homogeneous block: its TP group is a ``HyperCommGrid`` of shape [tp,1,1,1,1]
at ``rank_offset`` = the stage's first rank, so stages of different TP sizes and islands sit side by
side in one world. Pipeline, data-parallel and embedding groups of megatron's collection are
size-1 here: the heterogeneous runtime moves activations itself (``boundary.py``) and reduces
gradients itself (``grad_sync.py``), because neither fits megatron's uniform grid.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch.distributed as dist

from megatron_het.model.groups import GRID_DIMS, ensure_global_memory_buffer, group_options
from megatron_het.plan import Plan, rank_roles
from megatron_het.plan.experts import ExpertLayout, expert_groups, plan_expert_layouts, stage_expert_grids

# What each group of a stage's ProcessGroupCollection spans (build_stage_groups below): the stage's
# TP ranks, or this rank alone.
STAGE_WIDE_GROUPS = ("tp", "mp", "tp_cp", "tp_dp_cp", "expt_tp", "tp_ep_pp")
SELF_GROUPS = ("pp", "dp", "cp", "ep", "dp_cp", "embd", "pos_embd", "expt_dp")
# megatron-core's collection roles and the grid dims each spans
STAGE_GROUP_DIMS = (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("cp", "cp"), ("ep", "ep"), ("mp", ["tp", "pp"]),
                    ("tp_cp", ["tp", "cp"]), ("dp_cp", ["cp", "dp"]), ("tp_dp_cp", ["tp", "cp", "dp"]))


def check_contiguous_stages(plan: Plan) -> None:
    """A stage's ranks must be consecutive and ascending (one HyperCommGrid block)."""
    for r, replica in enumerate(plan.replicas):
        for s, stage in enumerate(replica.stages):
            expected = tuple(range(stage.ranks[0], stage.ranks[0] + len(stage.ranks)))
            if tuple(stage.ranks) != expected:
                raise ValueError(
                    f"replicas[{r}].stages[{s}].ranks: the runtime needs consecutive ascending ranks per "
                    f"stage (got {list(stage.ranks)}). Fix: use {list(expected)}-style ranges; "
                    f"tools/plan.py writes plans this way")


def plan_expert_layouts_of(plan: Plan, num_experts: int) -> dict[int, ExpertLayout]:
    """Every rank's place in its stage's expert grid (``plan/experts.plan_expert_layouts``)."""
    return plan_expert_layouts([[s.ranks for s in r.stages] for r in plan.replicas], num_experts=num_experts,
                               ep=plan.expert_parallel, etp=plan.expert_tensor_parallel)


def _expert_groups(plan: Plan, created: dict, rank: int, *, timeout, backend_of, device_id, library_of=None):
    """Create every stage's expert-parallel, expert-TP and (expert-TP x EP) groups (collective over the
    world, in plan order); return this rank's (ep, expt_tp, tp_ep), or None without expert parallelism.
    A grid whose ranks sit on islands of different collective libraries (``library_of``: island ->
    NCCL/RCCL/gloo) is refused, by every rank alike before any group is made: the MoE dispatcher's
    all-to-all does not go through the host-staged bridge yet."""
    if plan.expert_parallel == 1 and plan.expert_tensor_parallel is None:
        return None
    island_of = {r: s.island for rep in plan.replicas for s in rep.stages for r in s.ranks}
    grids = stage_expert_grids([[s.ranks for s in r.stages] for r in plan.replicas], ep=plan.expert_parallel,
                               etp=plan.expert_tensor_parallel)
    for ranks, _ in grids:
        libraries = {None if library_of is None else library_of(island_of[r]) for r in ranks}
        if len(libraries) > 1:
            raise ValueError(f"expert parallelism over ranks {list(ranks)}: their islands "
                             f"({sorted({island_of[r] for r in ranks})}) use different collective libraries "
                             f"({sorted(map(str, libraries))}), and the MoE all-to-all has no bridge between them "
                             "yet. Fix: keep each expert domain's replicas on islands of one vendor, or use "
                             "expert_parallel 1")
    mine = None
    for ranks, etp in grids:
        backend = None if backend_of is None else backend_of(island_of[ranks[0]])
        ep_groups, etp_groups = expert_groups(ranks, ep=plan.expert_parallel, etp=etp)
        got = []
        for group_list in (ep_groups, etp_groups, [list(ranks)]):
            for g in group_list:
                key = (tuple(sorted(g)), backend)
                if key not in created:
                    eager = device_id if len(g) > 1 else None
                    created[key] = dist.new_group(list(key[0]), **group_options(timeout, backend, eager))
                if rank in g:
                    got.append(created[key])
        if rank in ranks:
            mine = tuple(got)
    return mine


def build_stage_groups(plan: Plan, *, timeout: datetime.timedelta | None = None,
                       backend_of: Callable[[str], str] | None = None, device_id=None,
                       library_of: Callable[[str], str] | None = None):
    """Create every stage's groups (collective over the world); return this rank's collection.

    ``timeout``: the run's one timeout, given to every group (None: torch's 30-minute default);
    ``backend_of``: island name -> the accelerator's torch backend for that island's groups (None:
    the world's default); ``device_id``: ``Accelerator.eager_device`` (multi-rank GPU groups created
    at once; a rank's own group of one never communicates); ``library_of``: island name -> its
    collective library (expert groups must stay inside one)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    check_contiguous_stages(plan)
    rank = dist.get_rank()
    mine = None
    # One group per distinct (ranks, backend): the grid's nine roles span only two sets here (the TP
    # ranks, or this rank alone; one set at TP1), and on NCCL each group is a communicator with its
    # own buffers. The grid only enumerates ranks; every rank asks in the same (plan) order.
    created: dict[tuple[tuple[int, ...], str | None], object] = {}
    for replica in plan.replicas:
        for stage in replica.stages:
            backend = None if backend_of is None else backend_of(stage.island)
            grid = HyperCommGrid([stage.tp, 1, 1, 1, 1], list(GRID_DIMS), rank_offset=stage.ranks[0],
                                 backend=backend)
            pgs = {}
            for name, dims in STAGE_GROUP_DIMS:
                for ranks in grid.get_rank_enum(dims):
                    key = (tuple(sorted(ranks)), backend)
                    if key not in created:
                        eager = device_id if len(key[0]) > 1 else None
                        created[key] = dist.new_group(list(key[0]), **group_options(timeout, backend, eager))
                    if rank in ranks:
                        pgs[name] = created[key]
            if rank in stage.ranks:
                mine = pgs
    experts = _expert_groups(plan, created, rank, timeout=timeout, backend_of=backend_of, device_id=device_id,
                             library_of=library_of)
    if mine is None:
        raise ValueError(f"rank {rank} is not in the plan (world size {dist.get_world_size()}, plan uses "
                         f"{plan.world_size} ranks). Fix: launch exactly {plan.world_size} processes")
    pgc = ProcessGroupCollection(**mine)
    pgc.embd = mine["pp"]  # size 1: tied embeddings are synchronised by grad_sync, not megatron
    pgc.pos_embd = mine["pp"]
    # experts: without expert parallelism tensor-parallel over the stage's TP ranks like the dense MLP;
    # with it, the stage's expert grid (plan/experts.py). Gradients are reduced here (expt_dp: this rank)
    pgc.expt_dp, pgc.expt_tp, pgc.tp_ep, pgc.tp_ep_pp = mine["dp"], mine["tp"], mine["tp"], mine["mp"]
    if experts is not None:
        pgc.ep, pgc.expt_tp, pgc.tp_ep = experts
        pgc.tp_ep_pp = pgc.tp_ep
    ensure_global_memory_buffer()
    return pgc, rank_roles(plan)[rank]
