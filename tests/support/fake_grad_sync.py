"""The gradient synchronizer's groups of a large plan, rank by rank on torch's fake backend.

``GradientSynchronizer.__init__`` all-gathers every rank's holdings (``all_gather_object``, which a
fake world cannot answer), plans the buckets from them (``plan_buckets``) and creates every bucket's
group on every rank, in bucket order (``comm_routing.new_reduction_group``). Here the gather is
answered with ``runtime/holdings.plan_holdings`` (every rank's holdings from the plan and the model,
built once per stage shape), so each simulated rank runs the synchronizer's own constructor.

Groups are created on the fake world's backend: an accelerator whose backend is "fake" (on a real
launch it is gloo/NCCL/RCCL per island; a fake world cannot create those). A bucket spanning
collective libraries (NVIDIA beside AMD) goes through the cross-vendor bridge on a real launch
(``new_bridge_group``: per-island groups on the accelerators' backends and gloo between islands);
that construction cannot run on a fake world, so ``bridged_buckets`` records which buckets would be
bridged and the simulation routes every bucket natively (``placement=None``): the order and members
of the buckets' groups are checked, the bridge's own sub-groups are not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_het.cluster import CATALOG
from megatron_het.plan import Plan, rank_roles
from megatron_het.platform import Accelerator
from megatron_het.runtime.comm_routing import RankPlacement
from megatron_het.runtime.grad_sync import Bucket, GradientSynchronizer, Holding

FAKE_ACCELERATOR = Accelerator(kind="cpu", device_count=0, torch_backend="fake", device_name="cpu")
# the same, its tensors on the meta device: synchronizers over meta parameters lay out meta buffers
META_ACCELERATOR = dataclasses.replace(FAKE_ACCELERATOR, device=torch.device("meta"))


def by_rank(holdings: Sequence[Holding], world_size: int) -> list[list[Holding]]:
    """``plan_holdings``' flat list as ``all_gather_object`` returns it: one list per rank."""
    out: list[list[Holding]] = [[] for _ in range(world_size)]
    for h in holdings:
        out[h.rank].append(h)
    return out


def answer_gather_with(monkeypatch, gathered: Sequence[Sequence[Holding]]) -> None:
    """``dist.all_gather_object`` answers with ``gathered`` (one list per rank); what the simulated rank
    contributes must be its own entry (its local holdings are the plan's, not a stand-in)."""

    def all_gather_object(out: list, obj, group=None) -> None:
        if group is not None or len(out) != len(gathered):
            raise ValueError(f"all_gather_object: expected the world's gather of {len(gathered)} ranks, got "
                             f"group {group} and {len(out)} slots")
        if list(obj) != list(gathered[dist.get_rank()]):
            raise ValueError(f"rank {dist.get_rank()} contributes holdings other than plan_holdings' for it")
        out[:] = [list(hs) for hs in gathered]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)


def grad_sync_view(gathered: Sequence[Sequence[Holding]], *, timeout, bucket_numel: int | None = None):
    """A ``simulate_ranks`` builder: ``GradientSynchronizer`` constructed on the simulated rank from its
    holdings (the gather answered by ``answer_gather_with``), reduced to plain data: its buckets, and
    per group it kept (the buckets this rank reduces) the bucket and the group's members."""

    def local_shape(h: Holding) -> list[int]:  # a TP shard's shape (3D blocks: the full shape stands in)
        shape = list(h.full_shape)
        if h.partition_dim is not None and h.grid is None:
            shape[h.partition_dim] //= h.tp_size
        return shape

    def build(plan: Plan) -> dict:
        del plan
        local = gathered[dist.get_rank()]
        # meta parameters: the synchronizer lays each direct bucket's gradients out in one buffer
        params = {h.name: torch.nn.Parameter(torch.empty(local_shape(h), device="meta")) for h in local}
        sync = GradientSynchronizer(local, params, placement=None, bucket_numel=bucket_numel, timeout=timeout,
                                    accelerator=META_ACCELERATOR)
        return {"buckets": sync.buckets, "local": tuple(sync.local),
                "groups": [(b, tuple(dist.get_process_group_ranks(g.group))) for b, g in sync._groups]}

    return build


def dist_opt_view(gathered: Sequence[Sequence[Holding]], *, timeout):
    """A ``simulate_ranks`` builder: the distributed optimizer (optim/distributed.py) constructed on the
    simulated rank as the trainer constructs it (groups through ``new_reduction_group``), over meta
    parameters; its shard buckets (``plan_shard_buckets``) and the groups it kept. Only for plans of
    unsharded holdings (TP 1): a parameter's local shape is then its full shape."""
    import torch

    from megatron_het.optim.distributed import DistributedOptimizer
    from megatron_het.runtime.comm_routing import new_reduction_group, rank_placement_of
    from megatron_het.runtime.grad_sync import owned_norm_holdings
    from megatron_het.train.config import TrainConfig

    def build(plan: Plan) -> dict:
        local = gathered[dist.get_rank()]
        sharded = [h for h in local if h.tp_size > 1 or h.grid is not None]
        if sharded:
            raise ValueError(f"dist_opt_view: meta parameters of full shape stand only for TP 1 holdings; rank "
                             f"{dist.get_rank()} holds {sharded[0].name} at TP {sharded[0].tp_size}")
        params = {h.name: torch.empty(h.full_shape, device="meta") for h in local}
        train = TrainConfig(micro_batch_size=plan.micro_batch_size, global_batch_size=plan.global_batch_size,
                            train_iters=1)
        opt = DistributedOptimizer(local, params, train=train, device=torch.device("meta"), owned=owned_norm_holdings,
                                   new_group=lambda ranks: new_reduction_group(ranks, rank_placement_of(ranks),
                                                                               accelerator=FAKE_ACCELERATOR,
                                                                               timeout=timeout))
        return {"buckets": [b.ranks for b in opt.buckets],
                "groups": [(b.ranks, tuple(dist.get_process_group_ranks(g.group)))
                           for b, g in zip(opt.buckets, opt._groups) if g is not None]}

    return build


def grad_sync_problems(rank: int, view: dict, expected: Sequence[Bucket]) -> list[str]:
    """What is wrong with one simulated rank's synchronizer against ``expected`` (``plan_buckets`` of
    every rank's holdings): the buckets planned, the groups it kept, and that its buckets hold each of
    its parameters exactly once ([] when nothing)."""
    problems = []
    if list(view["buckets"]) != list(expected):
        problems.append(f"rank {rank}: planned {len(view['buckets'])} buckets, plan_buckets gives {len(expected)}")
    mine = [b for b in expected if rank in b.ranks]
    kept = [b for b, _ in view["groups"]]
    if kept != mine:
        problems.append(f"rank {rank}: keeps groups of buckets {[b.ranks[:4] for b in kept]}, belongs to "
                        f"{[b.ranks[:4] for b in mine]}")
    problems += [f"rank {rank}: group {members[:4]}... of bucket {b.ranks[:4]}... has other members"
                 for b, members in view["groups"] if members != b.ranks]
    names = [n for b in kept for n in b.names]
    if sorted(names) != sorted(view["local"]):
        missing, extra = set(view["local"]) - set(names), set(names) - set(view["local"])
        dup = sorted({n for n in names if names.count(n) > 1})
        problems.append(f"rank {rank}: its buckets miss {sorted(missing)[:3]}, add {sorted(extra)[:3]}, "
                        f"repeat {dup[:3]}")
    return problems


def catalog_placement(plan: Plan) -> RankPlacement:
    """Every rank's island and its device type's collective library (the catalog's, as a cluster file
    of those device types gives ``comm_routing.rank_placement``)."""
    roles = rank_roles(plan)
    device = {r: plan.replicas[role.replica].stages[role.stage].device_type for r, role in roles.items()}
    return RankPlacement(island={r: role.island for r, role in roles.items()},
                         library={r: CATALOG[d].collective_library for r, d in device.items()})


def bridged_buckets(buckets: Sequence[Bucket], placement: RankPlacement) -> list[Bucket]:
    """The buckets whose group a real launch routes through the cross-vendor bridge."""
    return [b for b in buckets if placement.spans_libraries(b.ranks)]


def group_ranks(creations: Sequence[tuple]) -> list[tuple[int, ...]]:
    """The members of each recorded ``new_group`` call, in order."""
    return [c[0] for c in creations]
