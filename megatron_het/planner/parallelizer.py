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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from megatron_het.cluster import ClusterSpec, IslandSpec, ModelSpec
from megatron_het.perf.axonn import GridCost, grid_cost
from megatron_het.perf.comm import island_channel
from megatron_het.perf.memory import stage_memory, state_bytes, unsharded_expert_parameters
from megatron_het.perf.predict import StageCost, stage_cost
from megatron_het.perf.profile import Profile
from megatron_het.plan import Plan, validate_plan
from megatron_het.plan.checks import tp3d_unsupported, tp_grid_divisors
from megatron_het.plan.types import fused_attention
from megatron_het.planner.space import moe_sequence_parallel, tp_options
from megatron_het.tp.grid import Grid4D

__all__ = ["AxonnParallelizer", "GridChoice", "IntraConfig", "LayerSlice", "MegatronParallelizer", "Parallelizer",
           "tp_grid_choice"]


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
    tp_grid: tuple[int, int, int] | None = None  # AxoNN 3D grid (gx, gy, gz) of the tp ranks; None: 1D TP


class Parallelizer(Protocol):
    """Candidate intra-island configurations of a slice; the planner composes the pairs."""

    name: str  # shown in explanations

    def candidates(self, slice_: LayerSlice, island_index: int, budget_bytes: int) -> Sequence[IntraConfig]:
        """Configurations of ``slice_`` on island ``island_index`` of the planner's cluster whose
        ``memory_bytes`` fit ``budget_bytes``, fastest first for each TP size (a configuration
        without recompute before one with it)."""
        ...


def memory_lines(model: ModelSpec, *, num_layers: int, **args) -> tuple[int, int, int, int]:
    """A stage rank's memory at ``num_layers`` layers and per extra layer, unsharded (``args``: the rest of
    ``stage_memory``'s, ``distributed_optimizer`` False): (bytes without the shardable optimizer state,
    that state, and both per extra layer). Under an expert grid the experts' optimizer state stays with
    the unsharded part, as stage_memory counts it whole. The planner shards the optimizer part over any
    replica count from one entry (the parallelizer's candidates, the estimator's memory lines)."""
    here = stage_memory(model, num_layers=num_layers, **args)
    more = stage_memory(model, num_layers=num_layers + 1, **args)
    e_here, e_more = (state_bytes(args.get("precision", "bf16"))[2] * unsharded_expert_parameters(
        model, num_layers=n, tp=args.get("tp", 1), ep=args.get("ep", 1)) for n in (num_layers, num_layers + 1))
    opt_here, opt_more = here.optimizer_bytes - e_here, more.optimizer_bytes - e_more
    return (here.total_bytes - opt_here, opt_here, more.total_bytes - opt_more - here.total_bytes + opt_here,
            opt_more - opt_here)


class MegatronParallelizer:
    """Megatron-style: TP (powers of two inside a node dividing heads, groups and MLP width) x
    full recompute off/on, priced by ``perf.predict.stage_cost`` and ``perf.memory.stage_memory``
    with the distributed optimizer sharded over ``data_parallel`` replicas."""

    name = "megatron"

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, *, max_tp: int = 8,
                 profile: Profile | Sequence[Profile] | None = None, distributed_optimizer: bool = True,
                 precision: str = "bf16", attention: str | None = None, expert_parallel: int = 1) -> None:
        self.model = model
        # an MoE plan's EP (Plan.expert_parallel, expert-TP = TP): a rank holds num_experts / EP experts, and
        # its all-to-all runs among EP replicas' TP ranks inside the island (a node when they fit in one)
        self.expert_parallel = expert_parallel
        self.attention = attention  # Plan.attention priced ("fused"/"unfused"); None: fused on GPUs
        self.precision = precision  # what the plan trains in: matmul rate, state and activation bytes
        self.cluster = cluster
        self.max_tp = max_tp  # largest TP size offered
        self.profile = profile  # measured layer times per device type (or per island), or None (analytic)
        self.distributed_optimizer = distributed_optimizer  # shard optimizer state over the replicas
        self._costs: dict[tuple[int, int, int, bool], StageCost] = {}  # per-instance caches
        self._mem: dict[tuple[object, ...], tuple[int, int, int, int]] = {}
        self._tp_sizes: dict[int, tuple[int, ...]] = {}
        self._slice_lines: dict[tuple[object, ...], list[tuple[int, bool, StageCost, int, int, int, int]]] = {}

    def tp_sizes(self, island_index: int) -> tuple[int, ...]:
        if island_index not in self._tp_sizes:
            self._tp_sizes[island_index] = tp_options(self.model, self.cluster.islands[island_index], max_tp=self.max_tp)
        return self._tp_sizes[island_index]

    def _cost(self, isl: int, tp: int, mbs: int, recompute: bool) -> StageCost:
        key = (isl, tp, mbs, recompute)
        if key not in self._costs:
            island = self.cluster.islands[isl]
            ep = self.expert_parallel
            self._costs[key] = stage_cost(self.model, island, tp=tp, micro_batch_size=mbs, recompute=recompute,
                                          slowdown=self.cluster.slowdown(island.name), profile=self.profile,
                                          precision=self.precision,
                                          flash_attention=fused_attention(self.attention),
                                          sequence_parallel=moe_sequence_parallel(self.model), ep=ep,
                                          # a stage's expert group spans (EP-1) replicas' ranks and its own
                                          # TP (predict.expert_channels finds where): within a node only on a
                                          # one-node island here, so the estimate never prices a faster link
                                          ep_channel=island_channel(island, same_node=island.nodes == 1))
        return self._costs[key]

    def _memory(self, slice_: LayerSlice, tp: int, rc: bool, flash: bool) -> tuple[int, int, int, int]:
        """(bytes without optimizer state, optimizer bytes, and both per extra layer), unsharded;
        one entry serves every replica count."""
        key = (slice_.num_layers, slice_.is_first, slice_.is_last, slice_.micro_batch_size, slice_.in_flight, tp, rc,
               flash)
        if key not in self._mem:
            args = dict(is_first=slice_.is_first, is_last=slice_.is_last, micro_batch_size=slice_.micro_batch_size,
                        microbatches_in_flight=slice_.in_flight, tp=tp, recompute="full" if rc else "none",
                        distributed_optimizer=False, flash_attention=flash, precision=self.precision,
                        ep=self.expert_parallel)
            self._mem[key] = memory_lines(self.model, num_layers=slice_.num_layers, **args)
        return self._mem[key]

    def _lines(self, slice_: LayerSlice, isl: int) -> list[tuple[int, bool, StageCost, int, int, int, int]]:
        """Per (TP, recompute) offered: its cost and ``_memory``'s unsharded lines. Cached per slice
        less its replica count, which only shards the optimizer state: the planner asks for the same
        slice at many replica counts."""
        key = (isl, slice_.num_layers, slice_.is_first, slice_.is_last, slice_.micro_batch_size, slice_.in_flight,
               slice_.recompute_allowed)
        if key not in self._slice_lines:
            # fused (flash) attention on GPUs unless the plan records a kernel, as perf.predict prices it
            flash = (not self.cluster.islands[isl].device.is_host if self.attention is None
                     else fused_attention(self.attention))
            self._slice_lines[key] = [(tp, rc, self._cost(isl, tp, slice_.micro_batch_size, rc),
                                       *self._memory(slice_, tp, rc, flash))
                                      for tp in self.tp_sizes(isl)
                                      for rc in ((False, True) if slice_.recompute_allowed else (False,))]
        return self._slice_lines[key]

    def candidates(self, slice_: LayerSlice, island_index: int, budget_bytes: int) -> list[IntraConfig]:
        out = []
        shard = slice_.data_parallel if self.distributed_optimizer and slice_.data_parallel > 1 else 1
        for tp, rc, cost, rest, opt, rest_slope, opt_slope in self._lines(slice_, island_index):
            # Optimizer state is kept apart and sharded over the replicas (as the runtime does).
            total = rest + -(-opt // shard)
            if total > budget_bytes:
                continue
            out.append(IntraConfig(tp=tp, recompute=rc, cost=cost, memory_bytes=total,
                                   memory_per_layer_bytes=rest_slope + opt_slope / shard))
        return out


# ---------------------------------------------------------------------------------------------
# AxoNN 3D tensor parallelism as an intra-island option (perf/axonn.py prices it)

@dataclass(frozen=True, kw_only=True)
class GridChoice:
    """The 4D communication model's verdict on one stage's tensor-parallel group: the cheapest 3D
    grid against Megatron's 1D TP, per transformer layer and micro-batch."""

    tp: int  # ranks of the stage
    grid: tuple[int, int, int] | None  # the 3D grid to run, None when 1D TP is at least as cheap
    best_3d: tuple[int, int, int] | None  # the cheapest 3D grid (also when it loses); None: none divides
    exposed_1d_s: float  # exposed TP communication of 1D TP (grid [1, tp, 1], Megatron, no overlap)
    exposed_3d_s: float  # of ``best_3d``, chunked and overlapped as Linear3D runs it (inf when none)
    forward_delta_s: float  # 3D minus 1D exposed seconds in the forward (0 when 1D is kept)
    backward_delta_s: float  # the same for the backward

    def describe(self, island: str) -> str:
        ms_1d, ms_3d = self.exposed_1d_s * 1e3, self.exposed_3d_s * 1e3
        if self.grid is not None:
            return (f"{island} TP={self.tp}: 3D grid {list(self.grid)} (AxoNN), exposed TP communication "
                    f"{ms_3d:.3f} ms vs {ms_1d:.3f} ms for 1D TP per layer and micro-batch (4D model)")
        if self.best_3d is None:
            return (f"{island} TP={self.tp}: 1D TP, no 3D grid of {self.tp} ranks divides the model "
                    f"(or its gated MLP has no 3D layout)")
        return (f"{island} TP={self.tp}: 1D TP, cheaper than the best 3D grid {list(self.best_3d)} "
                f"({ms_1d:.3f} ms vs {ms_3d:.3f} ms exposed per layer and micro-batch, 4D model)")


def _grids(tp: int) -> list[tuple[int, int, int]]:
    divs = [d for d in range(1, tp + 1) if tp % d == 0]
    return [(a, b, tp // (a * b)) for a, b in itertools.product(divs, repeat=2) if tp % (a * b) == 0]


def tp_grid_choice(model: ModelSpec, island: IslandSpec, tp: int, *, micro_batch_size: int,
                   bytes_per_element: int = 2) -> GridChoice:
    """Price every 3D grid of ``tp`` ranks (``perf/axonn.grid_cost``, one layer, one micro-batch of
    ``micro_batch_size * seq_length`` tokens) against 1D TP, the grid ``[1, tp, 1]``, which is exactly
    Megatron's layout (two all-reduces of the activations forward, two backward). A 3D grid is
    priced as ``tp/linear3d.Linear3D`` runs it: each GEMM's collectives chunked and overlapped with
    that GEMM's pieces (``exposed_chunked_s``; not AxoNN's cross-layer prefetch credit), 1D TP
    without overlap; 3D wins only when strictly cheaper."""
    one_layer = replace(model, num_layers=1)
    tokens = micro_batch_size * model.seq_length

    def cost(g: tuple[int, int, int]) -> GridCost | None:
        if any(size % div for _, size, _, div in tp_grid_divisors(g, model)):
            return None
        try:
            return grid_cost(one_layer, island, Grid4D(x=g[0], y=g[1], z=g[2]), batch_tokens=tokens,
                             bytes_per_element=bytes_per_element)
        except ValueError:  # the token count or a GEMM does not split over this grid
            return None

    one = cost((1, tp, 1))
    if one is None:
        raise ValueError(f"tp: {tp} ranks do not split {model.name or 'the model'} as 1D TP (grid [1, {tp}, 1]). "
                         f"Fix: ask only for TP sizes the Megatron parallelizer offers")
    # models the 3D layers do not build (plan/checks.tp3d_unsupported) get no grid
    priced = [] if tp3d_unsupported(model) else [(c.exposed_chunked_s, g, c) for g in _grids(tp)
                                      if g != (1, tp, 1) and (c := cost(g)) is not None]
    if not priced:
        return GridChoice(tp=tp, grid=None, best_3d=None, exposed_1d_s=one.exposed_s, exposed_3d_s=float("inf"),
                          forward_delta_s=0.0, backward_delta_s=0.0)
    exposed, g, best = min(priced, key=lambda p: (p[0], p[2].total_volume_bytes, p[1]))
    if exposed >= one.exposed_s:
        return GridChoice(tp=tp, grid=None, best_3d=g, exposed_1d_s=one.exposed_s, exposed_3d_s=exposed,
                          forward_delta_s=0.0, backward_delta_s=0.0)
    fwd = best.exposed_chunked_forward_s - one.exposed_forward_s
    bwd = (best.exposed_chunked_s - best.exposed_chunked_forward_s) - (one.exposed_s - one.exposed_forward_s)
    return GridChoice(tp=tp, grid=g, best_3d=g, exposed_1d_s=one.exposed_s, exposed_3d_s=exposed,
                      forward_delta_s=fwd, backward_delta_s=bwd)


class AxonnParallelizer(MegatronParallelizer):
    """Megatron's configurations plus, for each TP size > 1, AxoNN's 3D grid of those ranks when the
    4D model (``tp_grid_choice``) says it exposes less TP communication: that configuration comes
    first for its TP size, priced as the Megatron one with the per-layer exposed communication
    replaced (the 3D minus 1D difference, scaled by the island's emulation slowdown). Memory is
    Megatron's 1D figure (a 3D grid holds no more: the same weights per rank, fewer activations
    with z > 1).

    Opt-in (``plan_cluster(..., parallelizer=AxonnParallelizer(...))``): the pipeline runtime builds
    3D stages (model/tp3d_stage.py), with full recomputation and beside sequence-parallel stages, but
    not yet with interleaved chunks or the distributed optimizer (plan/validate.check_runtime_tp_grid), and
    ``perf.predict`` ranks the final plans with 1D TP communication (the 3D saving is the
    parallelizer's; the explanation states it)."""

    name = "megatron+axonn-3d"

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, **kw) -> None:
        super().__init__(model, cluster, **kw)
        self._choices: dict[tuple[int, int, int], GridChoice] = {}

    def grid_choice(self, island_index: int, tp: int, micro_batch_size: int) -> GridChoice:
        key = (island_index, tp, micro_batch_size)
        if key not in self._choices:
            self._choices[key] = tp_grid_choice(self.model, self.cluster.islands[island_index], tp,
                                                micro_batch_size=micro_batch_size)
        return self._choices[key]

    def candidates(self, slice_: LayerSlice, island_index: int, budget_bytes: int) -> list[IntraConfig]:
        out = []
        k = self.cluster.slowdown(self.cluster.islands[island_index].name)
        for c in super().candidates(slice_, island_index, budget_bytes):
            choice = self.grid_choice(island_index, c.tp, slice_.micro_batch_size) if c.tp > 1 else None
            if choice is not None and choice.grid is not None:
                cost = replace(c.cost,
                               layer_forward_s=max(0.0, c.cost.layer_forward_s + k * choice.forward_delta_s),
                               layer_backward_s=max(0.0, c.cost.layer_backward_s + k * choice.backward_delta_s))
                out.append(replace(c, cost=cost, tp_grid=choice.grid))  # first: the faster one for this TP
            out.append(c)
        return out

    def assign_tp_grids(self, plan: Plan) -> tuple[Plan, list[str]]:
        """``plan`` with ``tp_grid`` set on every stage whose TP group the 4D model runs faster as a 3D
        grid, and one explanation line per distinct (island, TP size)."""
        index = {isl.name: i for i, isl in enumerate(self.cluster.islands)}
        lines: dict[str, None] = {}
        replicas = []
        for r in plan.replicas:
            stages = []
            for s in r.stages:
                if s.tp > 1:
                    choice = self.grid_choice(index[s.island], s.tp, plan.micro_batch_size)
                    lines[choice.describe(s.island)] = None
                    if choice.grid is not None:
                        s = replace(s, tp_grid=choice.grid)
                stages.append(s)
            replicas.append(replace(r, stages=tuple(stages)))
        out = replace(plan, replicas=tuple(replicas))
        validate_plan(out, self.model, self.cluster)
        if any(s.tp_grid for r in out.replicas for s in r.stages):
            lines["(the predicted iteration time prices 1D TP communication; the 3D saving above is the "
                  "4D model's)"] = None
        return out, list(lines)
