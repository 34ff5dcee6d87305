"""The per-island parallelizer: the one place that decides how a model slice runs inside an island.

Tangram's split: the planner composes (model slice, island) pairs into pipelines; a homogeneous
*parallelizer* says how one slice runs on one island (tensor parallelism, recomputation, ...) and
what that costs. The interface is one method, ``candidates(slice, island, budget_bytes)``, which
returns every intra-island configuration worth considering with its time per micro-batch and its
memory per rank. :class:`MegatronParallelizer` (TP x full recompute, priced by ``perf``) is the
default; another parallelizer plugs in through ``plan_cluster(..., parallelizer=...)``
(docs/planner.md, "Plugging in a parallelizer").

What the planner assumes of a parallelizer (true for Megatron-style layer stacks): time and memory
are affine in the slice's layer count, so ``cost`` prices any layer count and
``memory_per_layer_bytes`` extends ``memory_bytes`` by one layer; the planner splits layers with
that line. Plans are still ranked at the end by ``perf.predict`` (Megatron's runtime), so a
parallelizer whose configurations the runtime cannot run must also teach the predictor about them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from megatron_het.cluster import ClusterSpec, ModelSpec
from megatron_het.perf.memory import stage_memory
from megatron_het.perf.predict import StageCost, stage_cost
from megatron_het.perf.profile import Profile
from megatron_het.planner.space import tp_options

__all__ = ["IntraConfig", "LayerSlice", "MegatronParallelizer", "Parallelizer"]


@dataclass(frozen=True, kw_only=True)
class LayerSlice:
    """A contiguous range of transformer layers as one pipeline stage will run it."""

    num_layers: int  # layers in the slice (the planner asks for 1 and extends with the per-layer slope)
    is_first: bool  # holds the embedding
    is_last: bool  # holds the output layer and the loss
    micro_batch_size: int  # sequences per micro-batch
    in_flight: int  # micro-batches whose activations the schedule keeps at once on this stage
    data_parallel: int  # replicas sharing this slice's optimizer state (distributed optimizer shards)
    recompute_allowed: bool  # the caller accepts configurations with activation recomputation


@dataclass(frozen=True, kw_only=True)
class IntraConfig:
    """One way to run a slice on an island, with its cost."""

    tp: int  # tensor-parallel size (ranks of the stage; they sit in one node)
    recompute: bool  # full activation recomputation
    cost: StageCost  # seconds per micro-batch, split so that any layer count can be priced
    memory_bytes: int  # peak bytes per rank for the slice as asked
    memory_per_layer_bytes: float  # extra bytes per rank for each further layer


class Parallelizer(Protocol):
    """Candidate intra-island configurations of a slice; the planner composes the pairs."""

    name: str  # shown in explanations

    def candidates(self, slice_: LayerSlice, island_index: int, budget_bytes: int) -> Sequence[IntraConfig]:
        """Configurations of ``slice_`` on island ``island_index`` of the planner's cluster whose
        ``memory_bytes`` fit ``budget_bytes``, fastest first for each TP size (a configuration
        without recompute before one with it)."""
        ...


class MegatronParallelizer:
    """Megatron-style: TP (powers of two inside a node dividing heads, groups and MLP width) x
    full recompute off/on, priced by ``perf.predict.stage_cost`` and ``perf.memory.stage_memory``
    with the distributed optimizer sharded over ``data_parallel`` replicas."""

    name = "megatron"

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, *, max_tp: int = 8,
                 profile: Profile | Sequence[Profile] | None = None, distributed_optimizer: bool = True) -> None:
        self.model = model
        self.cluster = cluster
        self.max_tp = max_tp  # largest TP size offered
        self.profile = profile  # measured layer times per device type, or None (analytic)
        self.distributed_optimizer = distributed_optimizer  # shard optimizer state over the replicas
        self._costs: dict[tuple[int, int, int, bool], StageCost] = {}  # per-instance caches
        self._mem: dict[tuple[object, ...], tuple[int, int, int, int]] = {}
        self._tp_sizes: dict[int, tuple[int, ...]] = {}

    def tp_sizes(self, island_index: int) -> tuple[int, ...]:
        if island_index not in self._tp_sizes:
            self._tp_sizes[island_index] = tp_options(self.model, self.cluster.islands[island_index], max_tp=self.max_tp)
        return self._tp_sizes[island_index]

    def _cost(self, isl: int, tp: int, mbs: int, recompute: bool) -> StageCost:
        key = (isl, tp, mbs, recompute)
        if key not in self._costs:
            island = self.cluster.islands[isl]
            self._costs[key] = stage_cost(self.model, island, tp=tp, micro_batch_size=mbs, recompute=recompute,
                                          slowdown=self.cluster.slowdown(island.name), profile=self.profile)
        return self._costs[key]

    def _memory(self, slice_: LayerSlice, tp: int, rc: bool, flash: bool) -> tuple[int, int, int, int]:
        """(bytes without optimizer state, optimizer bytes, and both per extra layer), unsharded;
        one entry serves every replica count."""
        key = (slice_.num_layers, slice_.is_first, slice_.is_last, slice_.micro_batch_size, slice_.in_flight, tp, rc,
               flash)
        if key not in self._mem:
            args = dict(is_first=slice_.is_first, is_last=slice_.is_last, micro_batch_size=slice_.micro_batch_size,
                        microbatches_in_flight=slice_.in_flight, tp=tp, recompute="full" if rc else "none",
                        distributed_optimizer=False, flash_attention=flash)
            here = stage_memory(self.model, num_layers=slice_.num_layers, **args)
            more = stage_memory(self.model, num_layers=slice_.num_layers + 1, **args)
            self._mem[key] = (here.total_bytes - here.optimizer_bytes, here.optimizer_bytes,
                              more.total_bytes - more.optimizer_bytes - here.total_bytes + here.optimizer_bytes,
                              more.optimizer_bytes - here.optimizer_bytes)
        return self._mem[key]

    def candidates(self, slice_: LayerSlice, island_index: int, budget_bytes: int) -> list[IntraConfig]:
        out = []
        shard = slice_.data_parallel if self.distributed_optimizer and slice_.data_parallel > 1 else 1
        flash = not self.cluster.islands[island_index].device.is_host
        for tp in self.tp_sizes(island_index):
            for rc in (False, True) if slice_.recompute_allowed else (False,):
                # fused (flash) attention on GPUs, as perf.predict assumes megatron-core runs it
                rest, opt, rest_slope, opt_slope = self._memory(slice_, tp, rc, flash)
                # Optimizer state is kept apart and sharded over the replicas (as the runtime does).
                total = rest + -(-opt // shard)
                slope = rest_slope + opt_slope / shard
                if total > budget_bytes:
                    continue
                out.append(IntraConfig(tp=tp, recompute=rc, cost=self._cost(island_index, tp, slice_.micro_batch_size, rc),
                                       memory_bytes=total, memory_per_layer_bytes=slope))
        return out
