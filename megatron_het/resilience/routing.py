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

Replicas of a heterogeneous plan rarely cut their stages at the same layers, so a lost stage is
*covered* by the union of surviving instances whose layer ranges overlap it (a lost stage of
layers 8-16 by one peer holding 6-12 running 8-12 and another holding 12-20 running 12-16; the
activation is handed from the first to the second at the split point). ``best_cover`` picks, among
all chains of such peers and split points, the one with the least added time (the busiest peer's
time afterwards, then the summed added time), from per-layer costs. A peer runs a sub-range of its
layers only when that keeps its role: a peer holding the embedding covers only ranges starting at
layer 0, a peer holding the output layer only ranges ending at the last layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
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
    hops: tuple[InstanceKey, ...]  # the chain of instances that run its layers, in layer order
    micro_batches: tuple[int, ...]  # global micro-batch indices, ascending
    spans: tuple[tuple[int, int], ...] = ()  # per hop, the [first, stop) global layers it runs (() = each
    # hop's whole range: no covers)

    def span(self, index: int, routing: Routing) -> tuple[int, int]:
        """Global layers hop ``index`` runs for this pipeline."""
        return self.spans[index] if self.spans else routing.instance(self.hops[index]).layers


@dataclass(frozen=True, kw_only=True)
class Takeover:
    """A lost stage instance and the peer that now runs its layers for the lost replica's pipeline."""

    lost: InstanceKey  # (replica, stage) that failed
    by: InstanceKey  # the peer instance that took (part of) it over
    micro_batches: tuple[int, ...]  # global micro-batches the peer runs on behalf of the lost instance
    layers: tuple[int, int] = (0, 0)  # [first, stop) global layers of the lost stage this peer runs


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

    def fraction(self, pipeline: Pipeline, index: int) -> float:
        """Share of hop ``index``'s own layers it runs for ``pipeline`` (1.0 unless it covers part of a range)."""
        lo, hi = pipeline.span(index, self)
        first, stop = self.instance(pipeline.hops[index]).layers
        return (hi - lo) / (stop - first)

    def windows(self, key: InstanceKey) -> dict[int, tuple[int, int]]:
        """Per global micro-batch that instance ``key`` runs on only part of its layers: the local
        [first, stop) decoder-layer indices it runs (the runtime's layer window)."""
        first = self.instance(key).layers[0]
        out = {}
        for p in self.pipelines:
            if key in p.hops:
                lo, hi = p.span(p.hops.index(key), self)
                if (lo, hi) != self.instance(key).layers:
                    out.update(dict.fromkeys(p.micro_batches, (lo - first, hi - first)))
        return out

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


def reroute(plan: Plan, failed: Iterable[int], *, seconds_per_micro_batch: Mapping[InstanceKey, float] | None = None,
            spread: int = 1) -> Routing:
    """Route every replica's share of the global batch around the failed ranks.

    ``seconds_per_micro_batch``: per original instance, its time per micro-batch (forward +
    backward), used to balance; default: 1 / its replica's micro-batch count in ``plan`` (the
    planner gives faster replicas more micro-batches). With no failures the plan's split is kept.
    ``spread``: a broken replica's share may be split into up to this many pipelines, each through
    different covering peers (ReCycle spreads a failed pipeline's micro-batches over all its
    data-parallel peers; 1 = one pipeline per replica). Raises ReroutingError when some stage's
    layers have no surviving holder.
    """
    if spread < 1:
        raise ValueError(f"spread: {spread} is below 1. Fix: pass 1 (one pipeline per replica) or more")
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
    spans_of: list[tuple[tuple[int, int], ...]] = []
    num_layers = max(st.layers[1] for r in plan.replicas for st in r.stages)
    replica_of: list[int] = []
    for ri, replica in enumerate(plan.replicas):
        broken = any((ri, si) not in by_key for si in range(len(replica.stages)))
        variants = min(spread, replica.num_micro_batches) if broken else 1
        share = replica.num_micro_batches / variants
        mine: list[tuple] = []  # this replica's pipelines so far: a repeated chain ends the spreading
        for _ in range(variants):
            hops, spans = _chain(ri, replica, by_key, alive, failed, plan, num_layers, cost, load, share)
            if (hops, spans) in mine:
                break
            mine.append((hops, spans))
            hops_of.append(tuple(hops))
            spans_of.append(tuple(spans))
            replica_of.append(ri)

    counts = [plan.replicas[ri].num_micro_batches if replica_of.index(ri) == v else 0
              for v, ri in enumerate(replica_of)]
    fractions = [[(sp[1] - sp[0]) / (by_key[k].layers[1] - by_key[k].layers[0]) for k, sp in zip(h, sps)]
                 for h, sps in zip(hops_of, spans_of)]
    if failed:
        counts = _balance(hops_of, fractions, cost, sum(counts))
    covered = any(f != 1.0 for fr in fractions for f in fr)
    pipelines, first = [], 0
    for ri, hops, spans, n in zip(replica_of, hops_of, spans_of, counts):
        pipelines.append(Pipeline(replica=ri, hops=hops, micro_batches=tuple(range(first, first + n)),
                                  spans=spans if covered else ()))
        first += n
    takeovers = []
    for p, spans in zip(pipelines, spans_of):
        stages = plan.replicas[p.replica].stages
        for hop, span in zip(p.hops, spans):
            if hop[0] == p.replica:
                continue
            for si, st in enumerate(stages):
                lo, hi = max(span[0], st.layers[0]), min(span[1], st.layers[1])
                if lo < hi:
                    takeovers.append(Takeover(lost=(p.replica, si), by=hop, micro_batches=p.micro_batches,
                                              layers=(lo, hi)))
    return Routing(failed=failed, instances=tuple(alive), pipelines=tuple(pipelines), retired=tuple(retired),
                   takeovers=tuple(takeovers), micro_batch_size=plan.micro_batch_size)


def _chain(ri, replica, by_key, alive, failed, plan, num_layers, cost, load, share):
    """The instances (and layers each runs) of one pipeline of replica ``ri``; ``load`` grows by
    ``share`` micro-batches on every covering peer, so the next variant picks other peers."""
    hops: list[InstanceKey] = []
    spans: list[tuple[int, int]] = []
    for si, st in enumerate(replica.stages):
        if (ri, si) in by_key:
            hops.append((ri, si))
            spans.append(tuple(st.layers))
            continue
        peers = [i for i in alive if i.key[0] != ri]
        chain = best_cover(tuple(st.layers), peers, num_layers=num_layers, cost=cost, load=load,
                           micro_batches=share)
        if chain is None:
            raise ReroutingError(
                f"replicas[{ri}].stages[{si}]: no surviving stages cover layers {list(st.layers)} after the "
                f"failure of ranks {sorted(failed)} (0 of {len(plan.replicas)} replicas hold them). Fix: restart "
                f"from the last checkpoint on the survivors (re-plan)")
        for key, span in chain:
            layers = by_key[key].layers
            load[key] += cost[key] * (span[1] - span[0]) / (layers[1] - layers[0]) * share
            if hops and hops[-1] == key:  # one peer covering adjacent lost stages: one hop
                spans[-1] = (spans[-1][0], span[1])
            else:
                hops.append(key)
                spans.append(span)
    return hops, spans


def best_cover(layers: tuple[int, int], peers: Sequence[StageInstance], *, num_layers: int,
               cost: Mapping[InstanceKey, float], load: Mapping[InstanceKey, float], micro_batches: int
               ) -> tuple[tuple[InstanceKey, tuple[int, int]], ...] | None:
    """The chain of peers covering ``layers`` with the least added time, or None if none covers them.

    Each element is (peer, [first, stop) it runs). A peer's time per layer is ``cost[peer]`` (one
    micro-batch through all its layers) over its layer count; it runs ``micro_batches`` micro-batches
    of the covered range on top of ``load[peer]``. Chains are compared by the busiest peer's time
    afterwards, then by the summed added time, then by fewer hand-offs (pure; exhaustive over
    split points by dynamic programming over layer positions).
    """
    first, stop = layers
    usable = []
    for p in peers:
        lo, hi = max(first, p.layers[0]), min(stop, p.layers[1])
        if lo >= hi:
            continue
        if p.is_first and lo != 0:  # it would have to take an activation instead of tokens
            continue
        if p.is_last and hi != num_layers:  # it would have to hand on an activation instead of a loss
            continue
        usable.append(p)
    best: dict[tuple[int, frozenset], tuple | None] = {}

    def solve(x: int, used: frozenset):
        """Best (busiest, added, hops, chain) covering [x, stop) without the peers in ``used`` (a peer
        runs one contiguous range)."""
        if x == stop:
            return (0.0, 0.0, 0, ())
        if (x, used) in best:
            return best[(x, used)]
        found = None
        for p in usable:
            if p.key in used or not p.layers[0] <= x < p.layers[1] or (p.is_first and x != 0):
                continue
            per_layer = cost[p.key] / (p.layers[1] - p.layers[0]) * micro_batches
            for y in range(x + 1, min(stop, p.layers[1]) + 1):
                if p.is_last and y != num_layers:
                    continue
                rest = solve(y, used | {p.key})
                if rest is None:
                    continue
                added = per_layer * (y - x)
                cand = (max(load[p.key] + added, rest[0]), added + rest[1], rest[2] + 1, ((p.key, (x, y)),) + rest[3])
                if found is None or cand[:3] < found[:3]:
                    found = cand
        best[(x, used)] = found
        return found

    result = solve(first, frozenset())
    return None if result is None else result[3]


def _balance(hops_of: list[tuple[InstanceKey, ...]], fractions: list[list[float]], cost: Mapping[InstanceKey, float],
             total: int) -> list[int]:
    """Give micro-batches one by one to the pipeline whose busiest instance stays least busy
    (``fractions[v][i]``: share of hop i's layers pipeline v runs on it)."""
    counts = [0] * len(hops_of)
    busy = dict.fromkeys(cost, 0.0)

    def after(v: int) -> tuple:
        return (max(busy[k] + cost[k] * f for k, f in zip(hops_of[v], fractions[v])),
                sum(busy[k] for k in hops_of[v]), v)

    for _ in range(total):
        best = min(range(len(hops_of)), key=after)
        counts[best] += 1
        for k, f in zip(hops_of[best], fractions[best]):
            busy[k] += cost[k] * f
    return counts


def describe(routing: Routing) -> list[str]:
    """One line per takeover and per retired rank (what the failure log prints)."""
    lines = []
    for t in routing.takeovers:
        by = routing.instance(t.by)
        part = "" if t.layers == by.layers else f" on layers {t.layers[0]}-{t.layers[1]} of its {by.layers[0]}-{by.layers[1]}"
        lines.append(f"stage {t.lost[1]} of replica {t.lost[0]} (lost) -> replica {t.by[0]} stage {t.by[1]} "
                     f"(ranks {list(by.ranks)}){part} runs global micro-batches {list(t.micro_batches)}")
    if routing.retired:
        lines.append(f"ranks {list(routing.retired)} retire (their TP group lost a member)")
    return lines
