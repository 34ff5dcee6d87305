"""Memory and time of one iteration of uneven sharded data parallelism (Cephalo mode).

Every rank runs the whole model (TP=1, PP=1) on its own micro-batches, one micro-batch in flight.
What a rank holds at its peak (what ``megatron_het.sharding.ShardedTrainer`` allocates):

- working weights of the whole model, gathered for compute (``working_param_bytes``/param; bf16 on a GPU);
- a full-size gradient buffer, accumulated over the rank's micro-batches and reduce-scattered once
  per iteration (``grad_bytes``/param; fp32 as Megatron's DDP keeps it);
- its shard of the training state, ``state_bytes`` per owned parameter: in mixed precision fp32 main
  values and Adam's two moments (12); in fp32 the moments only (8: the parameters are the main values,
  as the shared ``optim.DistributedOptimizer`` keeps them), i.e. ``shard_fraction x P x state_bytes``;
- activations of one micro-batch of its own size (Korthikanti terms of ``perf.memory``), with its
  own recompute choice; plus the fixed framework overhead.

So the state share is the only part the plan moves between ranks; a rank's *free* memory is its
capacity minus everything else, and memory-proportional fractions are ``free_r / sum(free)``.

Time: ``max_r(compute_r) + all-gather(weights) + reduce-scatter(grads) + max_r(optimizer_r)``.
The uneven collectives run as a ring over the padded largest shard (``sharding/collectives.py``):
``(n - 1) x (latency + max_shard_bytes / bandwidth)``, over the slowest link the ring crosses
(ranks are ordered island by island, so it crosses each island boundary once).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from megatron_het.cluster import ClusterSpec, IslandSpec, ModelSpec
from megatron_het.perf.bounds import check_global_batch_size
from megatron_het.perf.comm import bytes_per_s, p2p_channel
from megatron_het.perf.flops import total_parameters
from megatron_het.perf.memory import DEFAULT_OVERHEAD_BYTES, StageMemory, runtime_state_bytes, stage_memory
from megatron_het.perf.predict import check_island_profiles, optimizer_step_s, stage_cost
from megatron_het.perf.profile import Profile

__all__ = ["Precision", "StateBytes", "state_bytes_for", "sharded_rank_memory", "free_state_bytes",
           "rank_compute_s", "uneven_ring_s", "ring_channel", "RankPrediction", "ShardedPrediction",
           "predict_sharded_ranks"]

# "mixed" (bf16 compute, fp32 gradients and state) and "fp32" as before; or the run's precision as a plan
# names it: "bf16"/"fp16"/"fp8" store like "mixed", "tf32" like "fp32", and each is its own compute rate
Precision = Literal["mixed", "fp32", "tf32", "bf16", "fp16", "fp8"]
_STORAGE = {"mixed": "mixed", "bf16": "mixed", "fp16": "mixed", "fp8": "mixed", "fp32": "fp32", "tf32": "fp32"}


def compute_precision(precision: Precision) -> str:
    """The plan precision whose compute rates price the sharded run (``mixed``: bf16)."""
    check_precision(precision)
    return "bf16" if precision == "mixed" else precision


def check_precision(precision: str) -> None:
    if precision not in _STORAGE:
        raise ValueError(f"precision: must be one of {tuple(_STORAGE)} (got {precision!r}). Fix: pick one of them")


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Bytes per parameter of each part of a rank's model state."""

    working_param_bytes: int  # gathered weights used for compute (full model on every rank)
    grad_bytes: int  # local full-size gradient accumulation buffer
    state_bytes: int  # per *owned* parameter: exp_avg + exp_avg_sq (+ fp32 main values in mixed precision)
    activation_scale: float  # activation bytes relative to the bf16 Korthikanti figures


def state_bytes_for(precision: Precision) -> StateBytes:
    """``mixed``: bf16 weights, fp32 grads and state (GPU). ``fp32``: what the CPU runtime holds. The
    bytes are the pipeline runtime's with the distributed optimizer (one optimizer serves both modes)."""
    check_precision(precision)
    mixed = _STORAGE[precision] == "mixed"
    weights, grads, state = runtime_state_bytes("bf16" if mixed else "fp32", distributed_optimizer=True)
    return StateBytes(working_param_bytes=weights, grad_bytes=grads, state_bytes=state,
                      activation_scale=1.0 if mixed else 2.0)


def sharded_rank_memory(model: ModelSpec, *, shard_fraction: float, micro_batch_size: int, recompute: bool,
                        precision: Precision = "mixed", overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
                        num_parameters: int | None = None) -> StageMemory:
    """Peak bytes of one rank (``optimizer_bytes`` is its state shard; see the module docstring)."""
    if not 0.0 <= shard_fraction <= 1.0:
        raise ValueError(f"shard_fraction: must be in [0, 1] (got {shard_fraction}). Fix: pass the rank's share")
    sb = state_bytes_for(precision)
    p = total_parameters(model) if num_parameters is None else num_parameters
    whole = stage_memory(model, num_layers=model.num_layers, is_first=True, is_last=True,
                         micro_batch_size=micro_batch_size, microbatches_in_flight=1,
                         recompute="full" if recompute else "none", distributed_optimizer=False,
                         overhead_bytes=overhead_bytes)
    return StageMemory(parameters_bytes=sb.working_param_bytes * p, gradients_bytes=sb.grad_bytes * p,
                       optimizer_bytes=math.ceil(sb.state_bytes * p * shard_fraction),
                       activations_bytes=math.ceil(sb.activation_scale * whole.activations_bytes),
                       overhead_bytes=overhead_bytes)


def free_state_bytes(capacity_bytes: int, memory: StageMemory) -> int:
    """Bytes left for the state shard: capacity minus everything except the shard (may be < 0)."""
    return capacity_bytes - (memory.total_bytes - memory.optimizer_bytes)


def rank_compute_s(model: ModelSpec, island: IslandSpec, *, micro_batch_size: int, num_micro_batches: int,
                   recompute: bool, slowdown: float = 1.0,
                   profile: Profile | Sequence[Profile] | None = None, precision: Precision = "mixed") -> float:
    """Forward + backward seconds of a rank's micro-batches through the whole model, at the compute
    rate of ``precision`` (:func:`compute_precision`)."""
    if num_micro_batches == 0:
        return 0.0
    cost = stage_cost(model, island, tp=1, micro_batch_size=micro_batch_size, slowdown=slowdown,
                      recompute=recompute, profile=profile, precision=compute_precision(precision))
    L = model.num_layers
    per_micro = cost.forward_s(L, is_first=True, is_last=True) + cost.backward_s(L, is_first=True, is_last=True)
    return num_micro_batches * per_micro


def ring_channel(cluster: ClusterSpec, islands: Sequence[str]) -> tuple[float, float]:
    """(bandwidth Gbit/s, latency us) of a ring over ranks on ``islands`` (one entry per rank, grouped)."""
    names = list(dict.fromkeys(islands))
    chans = []
    for name in names:
        if islands.count(name) > 1:
            isl = cluster.island(name)
            chans.append(p2p_channel(cluster, src=name, dst=name, same_node=isl.nodes == 1))
    if len(names) > 1:
        chans += [p2p_channel(cluster, src=a, dst=b) for a, b in zip(names, names[1:] + names[:1])]
    if not chans:
        return math.inf, 0.0
    return min(c.bandwidth_gbps for c in chans), max(c.latency_us for c in chans)


def uneven_ring_s(max_shard_bytes: float, *, n: int, bandwidth_gbps: float, latency_us: float) -> float:
    """Ring all-gather / reduce-scatter of uneven shards padded to the largest: ``n-1`` steps."""
    if n <= 1:
        return 0.0
    return (n - 1) * (latency_us * 1e-6 + max_shard_bytes / bytes_per_s(bandwidth_gbps))


@dataclass(frozen=True, kw_only=True)
class RankPrediction:
    """One rank of a sharded plan."""

    rank: int  # global rank
    island: str  # its island
    compute_s: float  # forward + backward of its micro-batches (with slowdown)
    optimizer_s: float  # AdamW over its shard, memory-bound
    memory: StageMemory  # peak bytes by part (optimizer = its state shard)
    capacity_bytes: int  # device memory

    @property
    def fits(self) -> bool:
        return self.memory.total_bytes <= self.capacity_bytes

    def to_json_dict(self) -> dict[str, object]:
        return {"rank": self.rank, "island": self.island, "compute_s": self.compute_s,
                "optimizer_s": self.optimizer_s, "memory_gib": self.memory.total_bytes / 2**30,
                "capacity_gib": self.capacity_bytes / 2**30, "fits": self.fits,
                "memory_parts_gib": {k: v / 2**30 for k, v in self.memory.parts().items()}}


@dataclass(frozen=True, kw_only=True)
class ShardedPrediction:
    """Predicted iteration of a sharded plan."""

    iteration_time_s: float  # compute + all_gather + reduce_scatter + optimizer
    compute_s: float  # slowest rank's forward + backward
    all_gather_s: float  # weights (working precision), padded uneven ring
    reduce_scatter_s: float  # fp32 gradients, padded uneven ring
    optimizer_s: float  # slowest rank's optimizer step
    tokens_per_s: float  # global_batch_size * seq_length / iteration_time_s
    fits: bool  # every rank fits its memory
    ranks: tuple[RankPrediction, ...]  # per rank, rank order

    def to_json_dict(self) -> dict[str, object]:
        return {"mode": "sharded", "iteration_time_s": self.iteration_time_s, "compute_s": self.compute_s,
                "all_gather_s": self.all_gather_s, "reduce_scatter_s": self.reduce_scatter_s,
                "optimizer_s": self.optimizer_s, "tokens_per_s": self.tokens_per_s, "fits": self.fits,
                "memory_gib_per_rank_max": max(r.memory.total_bytes for r in self.ranks) / 2**30,
                "ranks": [r.to_json_dict() for r in self.ranks]}


def predict_sharded_ranks(model: ModelSpec, cluster: ClusterSpec, *, islands: Sequence[str],
                          micro_batch_sizes: Sequence[int], num_micro_batches: Sequence[int],
                          shard_fractions: Sequence[float], recompute: Sequence[bool], global_batch_size: int,
                          precision: Precision = "mixed", profile: Profile | Sequence[Profile] | None = None,
                          capacity_bytes: Sequence[int] | None = None,
                          overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> ShardedPrediction:
    """Predict an iteration from per-rank lists (``planner.sharded`` wraps this for a ShardedPlan)."""
    check_global_batch_size(global_batch_size)
    check_island_profiles(profile, cluster, islands)
    n = len(islands)
    for name, seq in (("micro_batch_sizes", micro_batch_sizes), ("num_micro_batches", num_micro_batches),
                      ("shard_fractions", shard_fractions), ("recompute", recompute)):
        if len(seq) != n:
            raise ValueError(f"{name}: has {len(seq)} entries for {n} ranks. Fix: pass one entry per rank")
    p = total_parameters(model)
    sb = state_bytes_for(precision)
    ranks = []
    bases: dict[tuple[int, bool], StageMemory] = {}  # ranks differ in few (size, recompute) pairs: price each once
    computes: dict[tuple[str, int, int, bool], float] = {}
    for r in range(n):
        island = cluster.island(islands[r])
        key = (micro_batch_sizes[r], bool(recompute[r]))
        if key not in bases:
            bases[key] = sharded_rank_memory(model, shard_fraction=0.0, micro_batch_size=key[0], recompute=key[1],
                                             precision=precision, num_parameters=p, overhead_bytes=overhead_bytes)
        if not 0.0 <= shard_fractions[r] <= 1.0:
            raise ValueError(f"shard_fraction: must be in [0, 1] (got {shard_fractions[r]}). "
                             "Fix: pass the rank's share")
        mem = dataclasses.replace(bases[key], optimizer_bytes=math.ceil(sb.state_bytes * p * shard_fractions[r]))
        ckey = (islands[r], micro_batch_sizes[r], num_micro_batches[r], bool(recompute[r]))
        if ckey not in computes:
            computes[ckey] = rank_compute_s(model, island, micro_batch_size=ckey[1], num_micro_batches=ckey[2],
                                            recompute=ckey[3], slowdown=cluster.slowdown(islands[r]), profile=profile,
                                            precision=precision)
        comp = computes[ckey]
        opt = optimizer_step_s(island.device, round(p * shard_fractions[r]), profile=profile, island=islands[r],
                               precision=compute_precision(precision))
        cap = capacity_bytes[r] if capacity_bytes is not None else int(island.device.memory_gib * 2**30)
        ranks.append(RankPrediction(rank=r, island=islands[r], compute_s=comp, optimizer_s=opt, memory=mem,
                                    capacity_bytes=cap))
    bw, lat = ring_channel(cluster, list(islands))
    max_shard = max(shard_fractions) * p
    gather = uneven_ring_s(max_shard * sb.working_param_bytes, n=n, bandwidth_gbps=bw, latency_us=lat)
    scatter = uneven_ring_s(max_shard * sb.grad_bytes, n=n, bandwidth_gbps=bw, latency_us=lat)
    compute = max(r.compute_s for r in ranks)
    opt = max(r.optimizer_s for r in ranks)
    total = compute + gather + scatter + opt
    return ShardedPrediction(iteration_time_s=total, compute_s=compute, all_gather_s=gather,
                             reduce_scatter_s=scatter, optimizer_s=opt,
                             tokens_per_s=global_batch_size * model.seq_length / total,
                             fits=all(r.fits for r in ranks), ranks=tuple(ranks))
