"""Simulate single ranks of a large world in this process with torch's fake process-group backend.

``dist.init_process_group(backend="fake", ...)`` gives one process any rank of any world size: groups
are created as on a real launch (``get_process_group_ranks`` answers), but no data moves, so only code
that builds groups from the plan can run (``all_gather_object`` and every collective return nothing
useful). ``simulate_ranks`` runs a group builder as each chosen rank in turn and records every
``new_group`` call it makes, in order: torch requires every rank of the world to make the same calls in
the same order, and a rank-dependent order deadlocks a real launch. The gradient synchronizer's groups
need every rank's holdings, which ``all_gather_object`` cannot give here: tests/support/fake_grad_sync.py
answers it from ``runtime/holdings.plan_holdings``.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_het.plan import Plan

TIMEOUT = datetime.timedelta(minutes=7)  # the run's group timeout, passed as the trainer passes it
_NEW_GROUP = inspect.signature(c10d.new_group)


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int):
    """This process is ``rank`` of a fake world of ``world_size`` for the duration."""
    dist.init_process_group(backend="fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()  # the world and every group created in it


@dataclass(frozen=True)
class SimulatedRank:
    rank: int
    result: Any  # what the builder returned on this rank
    creations: tuple  # every new_group call: (ranks, backend, timeout, use_local_synchronization)


def record_new_group(monkeypatch) -> list:
    """Record every ``new_group`` call into the returned list (torch's own subgroup helpers and
    megatron-core's ``HyperCommGrid.create_pg`` call it through ``distributed_c10d``)."""
    log: list = []
    # torch's own function (decorated by torch itself: unwrap only a recorder of ours)
    real = getattr(c10d.new_group, "_het_recording_of", c10d.new_group)

    def recording(*args, **kwargs):
        a = _NEW_GROUP.bind(*args, **kwargs).arguments
        log.append((tuple(a.get("ranks") or ()), a.get("backend"), a.get("timeout"),
                    a.get("use_local_synchronization", False)))
        return real(*args, **kwargs)

    recording._het_recording_of = real
    monkeypatch.setattr(c10d, "new_group", recording)
    monkeypatch.setattr(dist, "new_group", recording)
    return log


def simulate_ranks(plan: Plan, ranks: Iterable[int], build: Callable[[Plan], Any], monkeypatch
                   ) -> dict[int, SimulatedRank]:
    """``build(plan)`` run as each of ``ranks`` of a fake world of ``plan.world_size``; ``result`` is
    passed through ``build``'s return (convert groups to members inside ``build``: the world is
    destroyed after each rank)."""
    log = record_new_group(monkeypatch)
    out = {}
    for rank in ranks:
        log.clear()
        with fake_rank(rank, plan.world_size):
            result = build(plan)
        out[rank] = SimulatedRank(rank=rank, result=result, creations=tuple(log))
    return out


def creation_order_mismatch(sims: dict[int, SimulatedRank]) -> str | None:
    """None when every simulated rank made the same ``new_group`` calls in the same order; else where
    the first rank that differs from the lowest simulated rank departs from it."""
    ref_rank = min(sims)
    ref = sims[ref_rank].creations
    for rank in sorted(sims):
        got = sims[rank].creations
        if got == ref:
            continue
        i = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        return (f"rank {rank} made {len(got)} new_group calls, rank {ref_rank} {len(ref)}; call {i} differs: "
                f"rank {ref_rank} {ref[i] if i < len(ref) else None}, rank {rank} {got[i] if i < len(got) else None}")
    return None


def sample_ranks(plan: Plan) -> list[int]:
    """A principled sample of a plan's ranks: 0 and the last, the first and last rank of every island,
    and the first and last rank of every distinct stage shape (island, TP size, layers, grid)."""
    picks = {0, plan.world_size - 1}
    by_island: dict[str, list[int]] = {}
    by_shape: dict[tuple, list[int]] = {}
    for replica in plan.replicas:
        for stage in replica.stages:
            by_island.setdefault(stage.island, []).extend(stage.ranks)
            shape = (stage.island, len(stage.ranks), stage.layers, stage.tp_grid)
            by_shape.setdefault(shape, []).extend(stage.ranks)
    for ranks in (*by_island.values(), *by_shape.values()):
        picks.update((min(ranks), max(ranks)))
    return sorted(picks)


# ---- the runtime's stage groups (runtime/stage_groups.build_stage_groups) ------------------------------
STAGE_WIDE = ("tp", "mp", "tp_cp", "tp_dp_cp", "expt_tp", "tp_ep_pp")  # the stage's ranks, TP order
SELF_ONLY = ("pp", "dp", "cp", "ep", "dp_cp", "embd", "pos_embd", "expt_dp")  # this rank alone


def stage_group_view(plan: Plan) -> dict:
    """``build_stage_groups`` as the trainer calls it (without ``backend_of``: every group on the fake
    world's backend, so a per-island backend choice is not what this checks), reduced to plain data: this rank's role, the members
    of each group of its collection and its rank within the TP group."""
    from megatron_het.runtime.stage_groups import build_stage_groups

    pgc, role = build_stage_groups(plan, timeout=TIMEOUT)
    return {"role": role, "tp_rank": dist.get_group_rank(pgc.tp, dist.get_rank()),
            "members": {n: tuple(dist.get_process_group_ranks(getattr(pgc, n))) for n in (*STAGE_WIDE, *SELF_ONLY)}}


def stage_group_problems(plan: Plan, sim: SimulatedRank) -> list[str]:
    """What is wrong with one simulated rank's stage groups, against the plan ([] when nothing)."""
    from megatron_het.plan import rank_roles

    r, view = sim.rank, sim.result
    role = rank_roles(plan)[r]
    stage = plan.replicas[role.replica].stages[role.stage]
    problems = [f"rank {r}: role {view['role']} != rank_roles {role}"] if view["role"] != role else []
    problems += [f"rank {r}: {n} group {m} != its stage's ranks {stage.ranks}"
                 for n, m in view["members"].items() if n in STAGE_WIDE and m != tuple(stage.ranks)]
    problems += [f"rank {r}: {n} group {m} != ({r},)" for n, m in view["members"].items()
                 if n in SELF_ONLY and m != (r,)]
    if view["tp_rank"] != role.tp_rank:
        problems.append(f"rank {r}: rank {view['tp_rank']} in its TP group, plan says tp_rank {role.tp_rank}")
    return problems


def expected_multi_rank_groups(plan: Plan) -> list[tuple[int, ...]]:
    """The groups of more than one rank that ``build_stage_groups`` creates, in order: per stage of TP > 1
    in plan order, its ranks once (megatron's tp, mp, tp_cp and tp_dp_cp share the one group over the
    same ranks; with pp = dp = cp = 1 the other five share this rank's group of one)."""
    return [tuple(s.ranks) for rep in plan.replicas for s in rep.stages if s.tp > 1]
