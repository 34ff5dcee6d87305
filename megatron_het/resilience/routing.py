"""Re-route a failed rank's micro-batches to data-parallel peers (pure functions, no processes).

A *stage instance* is one stage of one replica of the original plan (its TP group). When a rank
fails, its whole instance is lost (its TP group is broken); the instance's other TP ranks retire.
Every replica keeps carrying its share of the global batch as a *pipeline*: a chain of instances,
one per stage, where a lost stage is replaced by a surviving instance with the same layers in
another replica (ReCycle-style: the broken replica's surviving stages keep working and send their
activations around the hole through the peer). Micro-batch counts are then rebalanced across
pipelines so that the busiest instance does as little as possible; global micro-batch ``g`` is
always samples ``[g*mbs, (g+1)*mbs)``, whichever pipeline runs it, so every sample of a global batch
is processed exactly once and the update equals the failure-free one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from megatron_het.plan import Plan

InstanceKey = tuple[int, int]  # (replica, stage) in the original plan


class ReroutingError(ValueError):
    """The failures cannot be routed around (a stage has no surviving holder of its layers)."""


@dataclass(frozen=True, kw_only=True)
class StageInstance:
    """One surviving stage of one replica: a TP group that runs its layers for one or more pipelines."""

    key: InstanceKey  # (replica, stage) in the original plan
    ranks: tuple[int, ...]  # original global ranks, TP order
    layers: tuple[int, int]  # [first, stop) global layer indices
    is_first: bool  # holds the embedding (layers start at 0)
    is_last: bool  # holds the output layer and loss


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """The micro-batches of one original replica and the instances that run each of its stages."""

    replica: int  # original replica whose share this is
    hops: tuple[InstanceKey, ...]  # per stage, the instance that runs it
    micro_batches: tuple[int, ...]  # global micro-batch indices, ascending


@dataclass(frozen=True, kw_only=True)
class Takeover:
    """A lost stage instance and the peer that now runs its layers for the lost replica's pipeline."""

    lost: InstanceKey  # (replica, stage) that failed
    by: InstanceKey  # the peer instance that took it over
    micro_batches: tuple[int, ...]  # global micro-batches the peer runs on behalf of the lost instance


@dataclass(frozen=True, kw_only=True)
class Routing:
    """Who runs which micro-batches on which layers after a set of failures."""

    failed: frozenset[int]  # original ranks that failed (cumulative)
    instances: tuple[StageInstance, ...]  # surviving instances, by first original rank
    pipelines: tuple[Pipeline, ...]  # one per original replica (some may carry no micro-batches)
    retired: tuple[int, ...]  # surviving ranks of lost instances: they leave the job
    takeovers: tuple[Takeover, ...]  # for the log: who took over which micro-batches
    micro_batch_size: int  # sequences per micro-batch

    @property
    def survivors(self) -> tuple[int, ...]:
        """Original ranks that keep training, ascending; the new rank is the index in this tuple."""
        return tuple(sorted(r for inst in self.instances for r in inst.ranks))

    def new_rank(self, old_rank: int) -> int:
        return self.survivors.index(old_rank)

    def instance(self, key: InstanceKey) -> StageInstance:
        return next(i for i in self.instances if i.key == key)

    def instance_of(self, old_rank: int) -> StageInstance | None:
        return next((i for i in self.instances if old_rank in i.ranks), None)

    def load(self, key: InstanceKey) -> int:
        """Micro-batches the instance runs per iteration."""
        return sum(len(p.micro_batches) for p in self.pipelines if key in p.hops)

    def samples(self) -> list[int]:
        """Every sample index the pipelines process in one iteration (for accounting)."""
        mbs = self.micro_batch_size
        return [g * mbs + i for p in self.pipelines for g in p.micro_batches for i in range(mbs)]


def _instances(plan: Plan, failed: frozenset[int]) -> tuple[list[StageInstance], list[int]]:
    num_layers = max(st.layers[1] for r in plan.replicas for st in r.stages)
    alive, retired = [], []
    for ri, replica in enumerate(plan.replicas):
        for si, st in enumerate(replica.stages):
            if failed & set(st.ranks):
                retired += [r for r in st.ranks if r not in failed]
                continue
            alive.append(StageInstance(key=(ri, si), ranks=tuple(st.ranks), layers=tuple(st.layers),
                                       is_first=st.layers[0] == 0, is_last=st.layers[1] == num_layers))
    alive.sort(key=lambda i: i.ranks[0])
    return alive, sorted(retired)


def reroute(plan: Plan, failed: Iterable[int], *, seconds_per_micro_batch: Mapping[InstanceKey, float] | None = None
            ) -> Routing:
    """Route every replica's share of the global batch around the failed ranks.

    ``seconds_per_micro_batch``: per original instance, its time per micro-batch (forward +
    backward), used to balance; default: 1 / its replica's micro-batch count in ``plan`` (the
    planner gives faster replicas more micro-batches). With no failures the plan's split is kept.
    Raises ReroutingError when some stage's layers have no surviving holder.
    """
    failed = frozenset(int(r) for r in failed)
    unknown = sorted(failed - {r for rep in plan.replicas for r in rep.ranks})
    if unknown:
        raise ReroutingError(f"failed: ranks {unknown} are not in the plan (it uses ranks 0..{plan.world_size - 1}). "
                             f"Fix: report failures by global rank of the original plan")
    alive, retired = _instances(plan, failed)
    by_key = {i.key: i for i in alive}
    cost = {key: (seconds_per_micro_batch or {}).get(key, 1.0 / max(1, plan.replicas[key[0]].num_micro_batches))
            for key in by_key}
    # provisional load (own replica's share, plus substitutions so far) to spread substitutions
    load = {key: cost[key] * plan.replicas[key[0]].num_micro_batches for key in by_key}
    hops_of: list[tuple[InstanceKey, ...]] = []
    for ri, replica in enumerate(plan.replicas):
        hops = []
        for si, st in enumerate(replica.stages):
            if (ri, si) in by_key:
                hops.append((ri, si))
                continue
            peers = [i.key for i in alive if i.layers == tuple(st.layers)]
            if not peers:
                raise ReroutingError(
                    f"replicas[{ri}].stages[{si}]: no surviving stage holds layers {list(st.layers)} after the "
                    f"failure of ranks {sorted(failed)} (0 of {len(plan.replicas)} replicas). Fix: restart from "
                    f"the last checkpoint on the survivors (re-plan)")
            best = min(peers, key=lambda k: (load[k] + cost[k], k))
            load[best] += cost[best] * replica.num_micro_batches
            hops.append(best)
        hops_of.append(tuple(hops))

    counts = [r.num_micro_batches for r in plan.replicas]
    if failed:
        counts = _balance(hops_of, cost, sum(counts))
    pipelines, first = [], 0
    for ri, (hops, n) in enumerate(zip(hops_of, counts)):
        pipelines.append(Pipeline(replica=ri, hops=hops, micro_batches=tuple(range(first, first + n))))
        first += n
    takeovers = tuple(Takeover(lost=(p.replica, s), by=hop, micro_batches=p.micro_batches)
                      for p in pipelines for s, hop in enumerate(p.hops) if hop != (p.replica, s))
    return Routing(failed=failed, instances=tuple(alive), pipelines=tuple(pipelines), retired=tuple(retired),
                   takeovers=takeovers, micro_batch_size=plan.micro_batch_size)


def _balance(hops_of: list[tuple[InstanceKey, ...]], cost: Mapping[InstanceKey, float], total: int) -> list[int]:
    """Give micro-batches one by one to the pipeline whose busiest instance stays least busy."""
    counts = [0] * len(hops_of)
    busy = dict.fromkeys(cost, 0.0)
    for _ in range(total):
        best = min(range(len(hops_of)), key=lambda v: (max(busy[k] + cost[k] for k in hops_of[v]),
                                                        sum(busy[k] for k in hops_of[v]), v))
        counts[best] += 1
        for k in hops_of[best]:
            busy[k] += cost[k]
    return counts


def describe(routing: Routing) -> list[str]:
    """One line per takeover and per retired rank (what the failure log prints)."""
    lines = []
    for t in routing.takeovers:
        by = routing.instance(t.by)
        lines.append(f"stage {t.lost[1]} of replica {t.lost[0]} (lost) -> replica {t.by[0]} stage {t.by[1]} "
                     f"(ranks {list(by.ranks)}) runs global micro-batches {list(t.micro_batches)}")
    if routing.retired:
        lines.append(f"ranks {list(routing.retired)} retire (their TP group lost a member)")
    return lines
