"""Where routed experts sit in a pipeline plan: expert parallelism as megatron-core lays it out (pure).

megatron-core spreads a stage's experts over an expert grid carved from its tensor- and data-parallel
ranks: expert-TP (``etp``) fastest, then expert-parallel (``ep``). Here a plan's ``expert_parallel``
(EP) and ``expert_tensor_parallel`` (ETP; None: each stage's TP size) do the same over an **expert
domain**: ``k = EP x ETP / TP`` consecutive replicas of identical structure (the same stages, layers,
TP sizes and micro-batches, so their MoE layers meet in the same order), whose stage-``s`` ranks,
replica by replica in TP order, form the grid. ``k = 1``: experts spread over a stage's own TP ranks
(ETP < TP); ``ETP = TP``: over the same stage of ``EP`` replicas (Megatron's usual EP over DP).

A rank's experts are ``num_experts / EP`` consecutive global experts from ``ep_rank x that``;
megatron-core numbers them locally from 0 (``local_experts.i``), the checkpoint names them globally
(``checkpoint/full_state.global_name``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_het.plan.errors import PlanError

__all__ = ["ExpertLayout", "domain_of", "expert_domains", "expert_groups", "is_expert_param", "plan_expert_layouts",
           "rank_expert_layout", "stage_expert_grids"]

EXPERT_MARK = ".mlp.experts."  # routed experts' parameters (the router and shared experts are not)


def is_expert_param(name: str) -> bool:
    """A routed expert's parameter (split over expert-TP and EP, not over the stage's TP)."""
    return EXPERT_MARK in name


@dataclass(frozen=True, kw_only=True)
class ExpertLayout:
    """One rank's place in its stage's expert grid."""

    num_experts: int  # routed experts per MoE layer, whole model
    ep: int = 1  # expert-parallel size: ranks the experts are spread over
    ep_rank: int = 0  # this rank's index among them
    etp: int  # expert tensor-parallel size: ranks each expert's weights are split over
    etp_rank: int  # this rank's index among those

    @property
    def num_local(self) -> int:
        """Experts this rank holds."""
        return self.num_experts // self.ep

    @property
    def first_expert(self) -> int:
        """Global index of this rank's first expert."""
        return self.ep_rank * self.num_local

    def tp_coordinates(self, name: str, tp_rank: int, tp_size: int) -> tuple[int, int]:
        """(rank, size) of the tensor-parallel split of parameter ``name``: expert-TP for an expert's,
        the stage's TP otherwise."""
        return (self.etp_rank, self.etp) if is_expert_param(name) else (tp_rank, tp_size)


def expert_domains(num_replicas: int, replica_tp: Sequence[Sequence[int]], *, ep: int,
                   etp: int | None) -> int:
    """Replicas per expert domain (``k``), checked for every stage: ``EP x ETP`` must be a multiple of
    the stage's TP, the same multiple on every stage, and ``k`` must divide the replica count.
    ``replica_tp``: each replica's stage TP sizes."""
    ks = set()
    for tps in replica_tp:
        for tp in tps:
            e = tp if etp is None else etp
            if (ep * e) % tp:
                raise PlanError(field="expert_parallel", value=ep,
                                problem=f"EP {ep} x expert-TP {e} = {ep * e} is not a multiple of a stage's TP {tp}",
                                fix="choose EP x expert-TP as a multiple of every stage's TP size (expert-TP "
                                    "defaults to the stage's TP)")
            ks.add(ep * e // tp)
    if len(ks) != 1:
        raise PlanError(field="expert_parallel", value=ep,
                        problem=f"stages of different TP sizes span different numbers of replicas ({sorted(ks)}) "
                                f"under EP {ep}", fix="set expert_tensor_parallel so that EP x expert-TP / TP is the "
                                                      "same on every stage, or give every stage the same TP")
    k = ks.pop()
    if num_replicas % k:
        raise PlanError(field="expert_parallel", value=ep,
                        problem=f"an expert domain spans {k} replicas, which do not divide the plan's {num_replicas}",
                        fix=f"use a number of replicas divisible by {k}, or a smaller EP")
    return k


def domain_of(replica: int, k: int) -> range:
    """The replicas of ``replica``'s expert domain (``k`` consecutive replicas)."""
    first = replica - replica % k
    return range(first, first + k)


def expert_groups(domain_ranks: Sequence[int], *, ep: int, etp: int) -> tuple[list[list[int]], list[list[int]]]:
    """(EP groups, expert-TP groups) of one stage's expert grid over ``domain_ranks`` (the stage's
    ranks, replica by replica of the domain, TP order inside): expert-TP fastest, as megatron-core."""
    if len(domain_ranks) != ep * etp:
        raise ValueError(f"an expert grid of EP {ep} x expert-TP {etp} needs {ep * etp} ranks, got "
                         f"{len(domain_ranks)}. Fix: build it over the stage ranks of its expert domain")
    ep_groups = [[domain_ranks[t + etp * e] for e in range(ep)] for t in range(etp)]
    etp_groups = [list(domain_ranks[e * etp:(e + 1) * etp]) for e in range(ep)]
    return ep_groups, etp_groups


def rank_expert_layout(position: int, *, num_experts: int, ep: int, etp: int) -> ExpertLayout:
    """The layout of the rank at ``position`` in its stage's expert grid (``expert_groups`` order)."""
    return ExpertLayout(num_experts=num_experts, ep=ep, ep_rank=position // etp, etp=etp, etp_rank=position % etp)


def stage_expert_grids(replica_stage_ranks: Sequence[Sequence[Sequence[int]]], *, ep: int,
                       etp: int | None) -> list[tuple[tuple[int, ...], int]]:
    """Every stage's expert grid: (the domain's ranks of that stage in grid order, expert-TP size), one
    per (expert domain, stage index), in plan order. ``replica_stage_ranks``: each replica's stages'
    ranks (``Plan.replicas[r].stages[s].ranks``)."""
    k = expert_domains(len(replica_stage_ranks), [[len(s) for s in r] for r in replica_stage_ranks],
                       ep=ep, etp=etp)
    out = []
    for first in range(0, len(replica_stage_ranks), k):
        for s, stage_ranks in enumerate(replica_stage_ranks[first]):
            # by global rank: each stage's ranks are contiguous, so its TP blocks stay whole, and the
            # grid's expert-TP and EP groups number their members as torch does (new_group sorts them)
            ranks = tuple(sorted(r for rep in replica_stage_ranks[first:first + k] for r in rep[s]))
            out.append((ranks, etp or len(stage_ranks)))
    return out


def plan_expert_layouts(replica_stage_ranks: Sequence[Sequence[Sequence[int]]], *, num_experts: int, ep: int,
                        etp: int | None) -> dict[int, ExpertLayout]:
    """Rank -> its ExpertLayout, for every rank of a plan (``stage_expert_grids``). A rank's EP and
    expert-TP indices are its places in those groups by global rank, as torch numbers a group's
    members (``new_group`` sorts them) and megatron-core reads them (``ep_group.rank()``), which is the
    grid order only where the domain's replicas have ascending ranks."""
    out = {}
    for ranks, e in stage_expert_grids(replica_stage_ranks, ep=ep, etp=etp):
        ep_groups, etp_groups = expert_groups(ranks, ep=ep, etp=e)
        ep_rank = {r: sorted(g).index(r) for g in ep_groups for r in g}
        etp_rank = {r: sorted(g).index(r) for g in etp_groups for r in g}
        for rank in ranks:
            out[rank] = ExpertLayout(num_experts=num_experts, ep=ep, ep_rank=ep_rank[rank], etp=e,
                                     etp_rank=etp_rank[rank])
    return out
