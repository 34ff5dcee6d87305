"""Predict one training iteration of a plan: per-stage compute and memory, pipeline simulation,
data-parallel gradient reduction and the optimizer step.

Assumptions (docs/planner.md, "Prediction"):
- A stage's time per micro-batch is ``num_layers x layer_times`` (+ the embedding on the first
  stage, the output layer and loss on the last) plus the tensor-parallel traffic, which is exposed
  (Megatron runs it on the critical path) unless ``tp_comm_overlap`` is set, in which case it
  hides behind the layer's compute and only the excess is exposed. Everything is multiplied by
  the island's emulation slowdown (1.0 on a real cluster).
- Each replica's pipeline is simulated with its own micro-batch count by
  :func:`megatron_het.schedule.steady.pipeline_times` (the simulator, extended past its steady state
  for large counts); zero-bubble B and W each take half of the backward.
- Gradients (fp32, 4 bytes per parameter) are reduced by every rank right after its own schedule
  ends (megatron-het's runtime and Megatron's finalize_model_grads both do), so a stage's reduction
  starts when the last of its peers ends its last backward in the simulation; later stages reduce
  during earlier stages' cool-down. Replicas may have different layouts; a stage's peers are, in
  every replica, the stage holding the same first layer, and the reduction moves this stage's
  per-rank gradient bytes over :func:`dp_gradient_reduction` across those peers' islands. With the
  distributed optimizer the reduce-scatter + all-gather pair costs the same as the all-reduce in a
  ring, so the same time is used.
- ``overlap_grad_reduce=True`` (off by default, as in Megatron) models megatron-core's DDP option:
  stage 0 reduces in buckets during its last backward (:func:`overlapped_reduction_tail_s`); other
  stages are not bucketed by Megatron and reduce at their end as above. ``bucket_all_stages=True``
  models megatron-het's runtime with ``TrainConfig.overlap_grad_reduce`` instead, which buckets
  every stage the same way. A plan recording ``overlap_grad_reduce`` (what its run does) is priced
  as that runtime: every stage bucketed, except where the runtime cannot overlap: a reduction whose
  peers span collective libraries goes through the cross-vendor bridge, which has no asynchronous
  form (``runtime/overlap_grad.py``: those buckets wait for the end), and interleaved stages
  (whose chunks' last backwards come before the armed one) are priced without overlap. With the
  distributed optimizer that runtime's overlapped buckets all-reduce (each owner then takes its
  pieces: ``optim/distributed.py``'s reducer), and the updated weights' gather runs during the next
  forward (--overlap-param-gather), priced hidden except through the bridge, which has no
  asynchronous gather either.
- Precision is the plan's (``Plan.precision``): it sets the matmul rate (``DeviceType.rate_tflops``),
  the compute model's calibrated figures, bytes per weight/gradient/optimizer state and activation
  (perf/memory.py), the gradient bytes reduced and the optimizer step's traffic.
- Attention is what the plan records (``Plan.attention``: fused, or unfused with s x s scores held);
  a plan without the field: fused (flash) on GPUs, as transformer-engine's spec and the local spec's
  SDPA run it (``model/sdpa_attention.py``), unfused on CPUs; ``flash_attention=`` overrides.
- The optimizer step is memory-bound: ``OPTIMIZER_STEP_BYTES`` per parameter (sharded over the
  replicas with the distributed optimizer) at the device's memory bandwidth.
- Every iteration the trainer also runs ``SYNC_ALL_REDUCES_PER_ITERATION`` small all-reduce over
  every rank (the gradient norm for clipping and the loss report in one message; Megatron-LM runs
  them separately), priced by :func:`small_all_reduce_s`: the measured small-message all-reduce
  of a profile whose links were measured on as many ranks, else taken as negligible.
- iteration time = max(slowest replica's pipeline, latest end of a stage's reduction) + those
  synchronisations + the slowest stage's optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from megatron_het.cluster import ClusterSpec, ConfigError, DeviceType, IslandSpec, ModelSpec
from megatron_het.perf.bounds import check_global_batch_size
from megatron_het.perf.calibrate import with_measured_links
from megatron_het.perf.comm import (
    Channel,
    activation_message_bytes,
    distributed_optimizer_share,
    dp_gradient_reduction,
    island_channel,
    moe_dispatch_times,
    p2p_channel,
    p2p_time,
    spans_collective_libraries,
    tp_channel,
    tp_layer_comm_times,
)
from megatron_het.perf.compute import LayerTimes, compute_params_for, embedding_times, layer_times, logits_times
from megatron_het.perf.flops import model_flops_per_iteration, stage_parameters, word_embedding_parameters_per_rank
from megatron_het.perf.memory import (
    StageMemory,
    activation_element_bytes,
    device_capacity_bytes,
    microbatches_in_flight,
    plan_chunk_sizes,
    stage_memory,
    state_bytes,
)
from megatron_het.perf.profile import Profile, check_profile_precision
from megatron_het.plan.layout import chunk_layers
from megatron_het.plan.types import Plan, ReplicaPlan, StagePlan, fused_attention
from megatron_het.schedule import Action
from megatron_het.schedule.generators import SPLIT_BACKWARD_SCHEDULES
from megatron_het.schedule.steady import PipelineTimes, pipeline_times

__all__ = [
    "OPTIMIZER_STEP_BYTES",
    "StageCost",
    "StagePrediction",
    "ReplicaPrediction",
    "Prediction",
    "stage_cost",
    "profile_for",
    "check_island_profiles",
    "optimizer_step_s",
    "predict",
    "replica_trace",
    "bucket_parameters",
    "overlapped_reduction_tail_s",
    "stage_gradient_chunks",
]

# Adam step per parameter: read fp32 master, grad, exp_avg, exp_avg_sq (16), write master and the
# two moments (12) and the bf16 weight (2).
OPTIMIZER_STEP_BYTES = 30
# Per precision: fp16 also reads its fp16 gradient and writes the fp32 main grad (32); fp32/tf32 have
# no master copy: read weight, grad and two moments, write weight and moments (28).
SYNC_ALL_REDUCES_PER_ITERATION = 1  # gradient norm (clipping) and loss report share one all-reduce over all ranks
OPTIMIZER_STEP_BYTES_BY_PRECISION = {"bf16": 30, "fp8": 30, "fp16": 32, "fp32": 28, "tf32": 28}
_GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class StageCost:
    """Seconds per micro-batch on one rank of a stage, split so any layer count can be priced."""

    layer_forward_s: float  # one transformer layer's forward incl. exposed TP traffic and slowdown
    layer_backward_s: float  # its backward (with recomputation when on)
    embedding_forward_s: float  # first stage only
    embedding_backward_s: float  # first stage only
    output_forward_s: float  # last stage only: logits GEMM + cross entropy
    output_backward_s: float  # last stage only

    def forward_s(self, num_layers: int, *, is_first: bool, is_last: bool) -> float:
        return (num_layers * self.layer_forward_s + (self.embedding_forward_s if is_first else 0.0)
                + (self.output_forward_s if is_last else 0.0))

    def backward_s(self, num_layers: int, *, is_first: bool, is_last: bool) -> float:
        return (num_layers * self.layer_backward_s + (self.embedding_backward_s if is_first else 0.0)
                + (self.output_backward_s if is_last else 0.0))


def optimizer_step_s(device: DeviceType, params: int, *, profile: Profile | Sequence[Profile] | None = None,
                     precision: str = "bf16", island: str | None = None) -> float:
    """One Adam step over ``params`` parameters on ``device``: measured per parameter when the
    device's profile has it, else memory-bound at ``OPTIMIZER_STEP_BYTES`` (per precision) per
    parameter at the compute model's memory efficiency. ``island``: the island's own profile wins."""
    measured = profile_for(profile, device.name, island)
    if measured is not None and measured.optimizer_s_per_parameter is not None:
        return measured.optimizer_s_per_parameter * params
    state_bytes(precision)
    eff = compute_params_for(device, precision, profile=measured).memory_efficiency
    return OPTIMIZER_STEP_BYTES_BY_PRECISION[precision] * params / (device.memory_bandwidth_gbs * 1e9 * eff)


def small_all_reduce_s(cluster: ClusterSpec, ranks: int, *, profile: Profile | Sequence[Profile] | None = None,
                       islands: Sequence[str] = ()) -> float:
    """One all-reduce of a few bytes over ``ranks`` ranks, as measured: the smallest all-reduce sample
    of a profile whose links were measured on that many processes (tools/profile_host.py
    --comm-ranks; on a CPU host, process scheduling makes it milliseconds). Without such a
    measurement it is taken as negligible (on GPUs it is a few tens of microseconds, and the nominal
    figures of an emulated cluster would only steer the planner towards fewer ranks)."""
    if ranks <= 1:
        return 0.0
    profiles = () if profile is None else (profile,) if isinstance(profile, Profile) else tuple(profile)
    devices = {cluster.island(name).device.name for name in islands} if islands else None
    for p in profiles:
        if p.link is not None and p.link.ranks == ranks and (devices is None or p.device in devices):
            small = [t for op, b, t in p.link.samples if op == "all_reduce" and b <= 65536]
            if small:
                return min(small)
    return 0.0


def backward_split_shares(profile: Profile | Sequence[Profile] | None, device_name: str,
                          island: str | None = None) -> tuple[float, float]:
    """(B, W) of a split backward as shares of the fused backward on ``device_name`` (on ``island``):
    measured by the device's profile (profile_host times the split of the same layers), else half each."""
    prof = profile_for(profile, device_name, island)
    return prof.backward_split if prof is not None and prof.backward_split is not None else (0.5, 0.5)


def call_overhead_s(profile: Profile | Sequence[Profile] | None, device_name: str,
                    island: str | None = None) -> tuple[float, float, int]:
    """(forward, backward) fixed seconds of one model-chunk call on ``device_name`` and the stack size its
    per-layer times were measured at (each layer time holds 1/that of the call cost): measured by the
    device's profile (profile_host --call-overhead), else (0, 0, 1): nothing charged per call."""
    prof = profile_for(profile, device_name, island)
    if prof is None or prof.call_overhead is None:
        return 0.0, 0.0, 1
    # a fixed cost is not negative: a negative measured intercept is the noise of two medians, priced as none
    return max(0.0, prof.call_overhead[0]), max(0.0, prof.call_overhead[1]), prof.call_overhead_layers


def profile_for(profile: Profile | Sequence[Profile] | None, device_name: str,
                island: str | None = None) -> Profile | None:
    """The profile measured on ``device_name`` among those given, or None (analytic model): the one
    measured for ``island`` (Profile.island) if there is one, else one standing for every island."""
    if profile is None:
        return None
    profiles = [p for p in ((profile,) if isinstance(profile, Profile) else profile) if p.device == device_name]
    mine = next((p for p in profiles if island is not None and p.island == island), None)
    return mine if mine is not None else next((p for p in profiles if p.island is None), None)


def check_island_profiles(profile: Profile | Sequence[Profile] | None, cluster: ClusterSpec,
                          islands: Iterable[str]) -> None:
    """Refuse to price an island from the nominal catalog entry when its device type was profiled per
    island (Profile.island) but not for this island, and no profile stands for every island of it."""
    if profile is None:
        return
    profiles = (profile,) if isinstance(profile, Profile) else tuple(profile)
    for name in dict.fromkeys(islands):
        device = cluster.island(name).device.name
        tagged = sorted({p.island for p in profiles if p.device == device and p.island is not None})
        if tagged and profile_for(profiles, device, name) is None:
            raise ConfigError(f"the {device} profiles given were measured for island(s) {', '.join(tagged)}, "
                              f"not for island {name!r}", field="profile", value=name,
                              fix=f"pass island {name!r}'s own profile too (profiling.host writes one per island: "
                                  f"host_profile_<key>_<n>_{name}.json), or a profile without \"island\"")


def expert_channels(plan: Plan, cluster: ClusterSpec) -> dict[int, Channel]:
    """Rank -> the link its stage's expert grid spans (plan/experts.py): inside a node, between the
    island's nodes, or the slowest link between the domain's islands. Empty with experts held whole on
    every stage's TP group (EP 1, expert-TP = TP)."""
    from megatron_het.plan.experts import stage_expert_grids

    if plan.expert_parallel == 1 and plan.expert_tensor_parallel is None:
        return {}
    firsts = {name: ranks[0] for name, ranks in plan.island_ranks().items()}
    island_of = {r: st.island for rep in plan.replicas for st in rep.stages for r in st.ranks}
    out = {}
    for ranks, _ in stage_expert_grids([[s.ranks for s in r.stages] for r in plan.replicas],
                                       ep=plan.expert_parallel, etp=plan.expert_tensor_parallel):
        names = sorted({island_of[r] for r in ranks})
        if len(names) == 1:
            island = cluster.island(names[0])
            nodes = {(r - firsts[names[0]]) // island.gpus_per_node for r in ranks}
            channel = island_channel(island, same_node=len(nodes) == 1)
        else:
            channel = min((p2p_channel(cluster, src=a, dst=b) for a in names for b in names if a < b),
                          key=lambda c: c.bandwidth_gbps)
        out.update(dict.fromkeys(ranks, channel))
    return out


def moe_dispatch_extra(model: ModelSpec, island: IslandSpec, lt: LayerTimes, *, micro_batch_size: int, tp: int,
                       ep: int, etp: int, ep_channel: Channel | None, **kw) -> tuple[float, float]:
    """(forward, backward) seconds of an MoE layer's dispatcher traffic under the plan's grid (``tp``,
    ``ep``, ``etp``; the domain's links ``ep_channel``, None: the stage's own) beyond what the layer's
    times hold: a layer measured over several ranks (``lt.moe_grid``) holds its own grid's traffic over
    the links it was measured on (a node's: this host's for CPU profiles), so only the difference the
    plan's grid and links make is added, never less than nothing."""
    stage_link = tp_channel(island, tp)
    plan = moe_dispatch_times(model, micro_batch_size=micro_batch_size, tp=tp, ep=ep, etp=etp, tp_link=stage_link,
                              grid_link=ep_channel or stage_link, **kw)
    if lt.moe_grid is None:
        return plan.forward_s, plan.backward_s
    local = island_channel(island, same_node=True)
    m_ep, m_etp = lt.moe_grid
    held = moe_dispatch_times(model, micro_batch_size=micro_batch_size, tp=tp, ep=m_ep, etp=m_etp, tp_link=local,
                              grid_link=local, **kw)
    return max(0.0, plan.forward_s - held.forward_s), max(0.0, plan.backward_s - held.backward_s)


def stage_cost(model: ModelSpec, island: IslandSpec, *, tp: int, micro_batch_size: int, slowdown: float = 1.0,
               seq_length: int | None = None, recompute: bool = False, sequence_parallel: bool = False,
               tp_comm_overlap: bool = False, profile: Profile | Sequence[Profile] | None = None,
               precision: str = "bf16", flash_attention: bool | None = None,
               recompute_share: float = 1.0, ep: int = 1, ep_channel: Channel | None = None,
               etp: int | None = None) -> StageCost:
    """Per-micro-batch costs of a stage of ``tp`` ranks on ``island``. ``recompute`` is a bool (full)
    or a mode ("none", "selective", "full"); ``flash_attention`` None means fused on GPUs.
    ``recompute_share``: the share of the stage's layers that recompute (Megatron's block method,
    ``StagePlan.recomputed_layers / num_layers``); a layer's times are then the share-weighted mean of
    a recomputing and a plain layer, so ``num_layers x`` them is the stage's total. ``ep``/``ep_channel``:
    an MoE plan's expert parallelism and the link its all-to-all crosses (``moe_all_to_all_times``;
    every layer priced as an MoE layer, as the compute); ``etp``: its expert-TP size (None: ``tp``). The
    MoE token dispatcher's traffic is ``moe_dispatch_extra``'s (what a measured layer does not hold)."""
    mode = ("full" if recompute else "none") if isinstance(recompute, bool) else recompute
    if not 0.0 <= recompute_share <= 1.0:
        raise ConfigError("must be within [0, 1]", field="recompute_share", value=recompute_share,
                          fix="pass the recomputed layers / the stage's layers")
    kwargs = dict(tp=tp, micro_batch_size=micro_batch_size, slowdown=slowdown, seq_length=seq_length,
                  sequence_parallel=sequence_parallel, tp_comm_overlap=tp_comm_overlap, profile=profile,
                  precision=precision, flash_attention=flash_attention, ep=ep, ep_channel=ep_channel, etp=etp)
    if mode != "none" and recompute_share < 1.0:
        plain = stage_cost(model, island, recompute="none", **kwargs)
        if recompute_share == 0.0:
            return plain
        full = stage_cost(model, island, recompute=mode, **kwargs)
        a = recompute_share  # embedding and output are never recomputed: equal in both
        return replace(full, layer_forward_s=a * full.layer_forward_s + (1 - a) * plain.layer_forward_s,
                       layer_backward_s=a * full.layer_backward_s + (1 - a) * plain.layer_backward_s)
    device = island.device
    flash = not device.is_host if flash_attention is None else flash_attention
    lt = layer_times(model, device, micro_batch_size=micro_batch_size, seq_length=seq_length, tp=tp,
                     sequence_parallel=sequence_parallel, recompute=mode,
                     profile=profile_for(profile, device.name, island.name), precision=precision,
                     flash_attention=flash, ep=ep if (tp if etp is None else etp) == 1 else 1)
    comm = tp_layer_comm_times(model, island, micro_batch_size=micro_batch_size, tp=tp, seq_length=seq_length,
                               sequence_parallel=sequence_parallel, recompute=mode,
                               element_bytes=activation_element_bytes(precision))
    if lt.includes_tp_comm:  # measured on tp ranks together: its collectives are in the times already
        fwd_comm = bwd_comm = 0.0
    elif tp_comm_overlap:  # chunked overlap hides the traffic behind the GEMMs it feeds
        fwd_comm, bwd_comm = max(0.0, comm.forward_s - lt.forward_s), max(0.0, comm.backward_s - lt.backward_s)
    else:
        fwd_comm, bwd_comm = comm.forward_s, comm.backward_s
    if model.is_moe:  # the token dispatcher's traffic, what a measured entry does not already hold
        d_fwd, d_bwd = moe_dispatch_extra(model, island, lt, micro_batch_size=micro_batch_size, tp=tp, ep=ep,
                                          etp=tp if etp is None else etp, ep_channel=ep_channel, seq_length=seq_length,
                                          sequence_parallel=sequence_parallel, recompute=mode,
                                          element_bytes=activation_element_bytes(precision))
        fwd_comm, bwd_comm = fwd_comm + d_fwd, bwd_comm + d_bwd
    measured = profile_for(profile, device.name, island.name)
    emb = embedding_times(model, device, micro_batch_size=micro_batch_size, seq_length=seq_length, tp=tp,
                          profile=measured, precision=precision)
    out = logits_times(model, device, micro_batch_size=micro_batch_size, seq_length=seq_length, tp=tp,
                       profile=measured, precision=precision)
    k = slowdown
    return StageCost(
        layer_forward_s=k * (lt.forward_s + fwd_comm), layer_backward_s=k * (lt.backward_s + bwd_comm),
        embedding_forward_s=k * emb.forward_s, embedding_backward_s=k * emb.backward_s,
        output_forward_s=k * out.forward_s, output_backward_s=k * out.backward_s,
    )


@dataclass(frozen=True, kw_only=True)
class StagePrediction:
    """One stage of one replica (identical for every rank of its TP group)."""

    island: str  # island the stage runs on
    device_type: str  # its device type
    tp: int  # tensor-parallel size
    layers: tuple[int, int]  # [first, stop) transformer layers
    forward_s: float  # per micro-batch, all model chunks
    backward_s: float  # per micro-batch, all model chunks (incl. recomputation)
    compute_s: float  # busy time over the iteration's pipeline
    idle_s: float  # pipeline bubble of this stage
    gradient_reduction_s: float  # this stage's cross-replica gradient reduction (all of it)
    gradient_reduction_end_s: float  # when it ends: its peers' last backward (+ overlap) + the rest
    optimizer_s: float  # this stage's optimizer step
    memory: StageMemory  # peak bytes per rank, by part
    capacity_gib: float  # device memory per rank
    # (embedding fwd, bwd, output fwd, bwd) seconds inside forward_s/backward_s (stage_ends)
    ends_s: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    # with a split-backward schedule, B's and W's shares of a fused backward (backward_split_shares)
    backward_split: tuple[float, float] = (0.5, 0.5)
    # (forward, backward) seconds every model chunk's call costs beyond its layers, inside forward_s/backward_s
    call_overhead_s: tuple[float, float] = (0.0, 0.0)

    @property
    def memory_gib(self) -> float:
        return self.memory.total_bytes / _GIB

    @property
    def fits(self) -> bool:
        return self.memory.total_bytes <= self.capacity_gib * _GIB

    def to_json_dict(self) -> dict[str, object]:
        return {
            "island": self.island, "device_type": self.device_type, "tp": self.tp, "layers": list(self.layers),
            "forward_s": self.forward_s, "backward_s": self.backward_s, "compute_s": self.compute_s,
            "idle_s": self.idle_s, "gradient_reduction_s": self.gradient_reduction_s,
            "gradient_reduction_end_s": self.gradient_reduction_end_s,
            "optimizer_s": self.optimizer_s, "memory_gib": self.memory_gib, "capacity_gib": self.capacity_gib,
            "fits": self.fits,
            "memory_parts_gib": {k: v / _GIB for k, v in self.memory.parts().items()},
        }


@dataclass(frozen=True, kw_only=True)
class ReplicaPrediction:
    """One replica's pipeline."""

    num_micro_batches: int  # its share of the global batch
    pipeline_time_s: float  # simulated schedule, forward + backward of all its micro-batches
    bubble_fraction: float  # idle share of its stages over its pipeline time
    stages: tuple[StagePrediction, ...]  # pipeline order


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted iteration of a plan; ``to_json_dict`` names are stable (plan JSON "predicted")."""

    iteration_time_s: float  # max pipeline + gradient reduction + optimizer step
    pipeline_time_s: float  # slowest replica's pipeline
    gradient_reduction_s: float  # reduction time past the slowest pipeline's end (the exposed part)
    synchronization_s: float = 0.0  # the trainer's per-iteration small all-reduces over every rank
    optimizer_s: float  # slowest stage's optimizer step
    tokens_per_s: float  # global_batch_size * seq_length / iteration_time_s
    tflops_per_gpu: float  # model FLOPs (Megatron formula, no recompute) / (time * GPUs) / 1e12
    num_gpus: int  # ranks the plan places
    memory_gib_per_rank_max: float  # largest per-rank peak over all stages
    fits: bool  # every stage fits its device memory
    replicas: tuple[ReplicaPrediction, ...]  # one per plan replica, in plan order

    def to_json_dict(self) -> dict[str, object]:
        """Headline numbers plus per-stage details; identical replicas are listed once."""
        groups: dict[int, list[int]] = {}
        first: dict[int, ReplicaPrediction] = {}
        for i, r in enumerate(self.replicas):
            key = id(r)  # predict() shares the object between identical replicas
            groups.setdefault(key, []).append(i)
            first[key] = r
        return {
            "iteration_time_s": self.iteration_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "memory_gib_per_rank_max": self.memory_gib_per_rank_max,
            "fits": self.fits,
            "pipeline_time_s": self.pipeline_time_s,
            "gradient_reduction_s": self.gradient_reduction_s,
            "synchronization_s": self.synchronization_s,
            "optimizer_s": self.optimizer_s,
            "num_gpus": self.num_gpus,
            "replica_groups": [
                {"replicas": idx, "num_micro_batches": first[k].num_micro_batches,
                 "pipeline_time_s": first[k].pipeline_time_s, "bubble_fraction": first[k].bubble_fraction,
                 "stages": [s.to_json_dict() for s in first[k].stages]}
                for k, idx in groups.items()
            ],
        }


def _stage_key(stage: StagePlan) -> tuple[object, ...]:
    return (stage.island, stage.tp, stage.layers, stage.recompute, stage.recompute_num_layers, stage.tp_comm_overlap)


def _same_node(island: IslandSpec, a: StagePlan, b: StagePlan) -> bool:
    # Consecutive stages on one island share a node when both TP groups fit in one (ranks are
    # placed consecutively, TP first); otherwise the island's inter-node network carries it.
    return island.nodes == 1 or a.tp + b.tp <= island.gpus_per_node


def bucket_parameters(dp: int) -> int:
    """megatron-core DDP's default gradient bucket with overlap_grad_reduce: max(40M, 1M x dp)
    parameters (distributed_data_parallel.py); it buckets only pipeline stage 0."""
    return max(40_000_000, 1_000_000 * dp)


def overlapped_reduction_tail_s(chunks: Sequence[tuple[float, int]], *, backward_s: float, bucket_params: int,
                                reduce_s: Callable[[int], float]) -> float:
    """Seconds a bucketed gradient reduction runs past the end of the last backward it overlaps.

    ``chunks`` are (ready time from the start of that backward, parameters) in the order the
    backward produces them. Like megatron-core, a bucket closes once it holds ``bucket_params``
    (a chunk is never split), is launched when its last gradient is ready, and buckets reduce one
    after another; ``reduce_s(params)`` prices one bucket. When the network keeps up this is the
    last bucket's reduction; when it does not, the backlog is exposed too.
    """
    t, size, ready = 0.0, 0, 0.0
    for at, n in chunks:
        size, ready = size + n, at
        if size >= bucket_params:
            t, size = max(t, ready) + reduce_s(size), 0
    if size:
        t = max(t, ready) + reduce_s(size)
    return max(0.0, t - backward_s)


def stage_gradient_chunks(model: ModelSpec, cost: StageCost, *, num_layers: int, is_first: bool, is_last: bool,
                          tp: int, tied_elsewhere: bool = False) -> list[tuple[float, int]]:
    """(ready time in the stage's backward, parameters) in backward order: output layer, the
    layers last to first (each ready when its backward ends), then the embedding.
    ``tied_elsewhere``: the stage's rows of a tied word embedding are reduced in their own group
    (with the pipeline's other end), so they are left out here."""
    def params(n: int, first: bool, last: bool) -> int:
        return stage_parameters(model, num_layers=n, is_first=first, is_last=last, tp=tp)

    rows = word_embedding_parameters_per_rank(model, tp=tp) if tied_elsewhere else 0
    out = []
    t = cost.output_backward_s if is_last else 0.0
    if is_last:  # final norm + output layer (minus the embedding when tied on a one-stage pipeline)
        out.append((t, params(0, is_first, True) - params(0, is_first, False) - (rows if not is_first else 0)))
    per_layer = params(1, False, False)
    for _ in range(num_layers):
        t += cost.layer_backward_s
        out.append((t, per_layer))
    if is_first:
        out.append((t + cost.embedding_backward_s, params(0, True, False) - rows))
    return out


def predict(plan: Plan, model: ModelSpec, cluster: ClusterSpec, *, profile: Profile | Sequence[Profile] | None = None,
            distributed_optimizer: bool | None = None, seq_length: int | None = None,
            overlap_grad_reduce: bool = False, bucket_all_stages: bool = False,
            flash_attention: bool | None = None, recompute_mode: str | None = None,
            simulations: dict | None = None) -> Prediction:
    """Predict one iteration of ``plan`` (assumed valid: run validate_plan first).

    ``overlap_grad_reduce`` models megatron-core's DDP option of that name (stage 0 reduces in
    buckets during its last backward); with ``bucket_all_stages`` every stage does, as
    megatron-het's runtime with ``TrainConfig.overlap_grad_reduce``. Both default to False (the
    reduction runs after the schedule). ``flash_attention`` None: fused on GPUs, unfused on CPUs.
    ``recompute_mode`` ("selective" or "full") says what a stage's ``recompute=True`` means (default full).
    ``simulations``: a dict kept by the caller across calls with the same model, cluster, profile and
    options (the planner's), so that plans differing only in gradient reduction or optimizer
    sharding share their replicas' pipeline simulations.
    """
    check_global_batch_size(plan.global_batch_size)  # bounds every replica's micro-batch count
    if flash_attention is None:  # the plan records the kernel it runs (None: the device decides)
        flash_attention = fused_attention(plan.attention)
    if profile is not None:  # measured times price only the precision they were taken in
        check_profile_precision((profile,) if isinstance(profile, Profile) else profile, plan.precision,
                                {island.device.name for island in cluster.islands})
        check_island_profiles(profile, cluster, (st.island for r in plan.replicas for st in r.stages))
    if plan.overlap_grad_reduce:  # what the runtime runs for this plan (module docstring)
        overlap_grad_reduce = bucket_all_stages = True
    precision = plan.precision
    param_bytes, grad_bytes, _ = state_bytes(precision)
    cluster = with_measured_links(cluster, profile)
    dist_opt = plan.use_distributed_optimizer if distributed_optimizer is None else distributed_optimizer
    s_len = model.seq_length if seq_length is None else seq_length
    mbs, v, sp = plan.micro_batch_size, plan.virtual_pipeline_size, plan.sequence_parallel
    dp = len(plan.replicas)
    costs: dict[tuple[object, ...], StageCost] = {}

    ep_links = expert_channels(plan, cluster) if model.is_moe else {}

    def cost(stage: StagePlan) -> StageCost:
        share = stage.recomputed_layers(v) / stage.num_layers if stage.recompute_num_layers else 1.0
        ep_channel = ep_links.get(stage.ranks[0])
        key = (stage.island, stage.tp, stage.recompute, share, stage.tp_comm_overlap, ep_channel)
        if key not in costs:
            island = cluster.island(stage.island)
            mode = (recompute_mode or "full") if stage.recompute else "none"
            costs[key] = stage_cost(model, island, tp=stage.tp, micro_batch_size=mbs, seq_length=s_len,
                                    slowdown=cluster.slowdown(stage.island), recompute=mode,
                                    sequence_parallel=sp, tp_comm_overlap=stage.tp_comm_overlap, profile=profile,
                                    precision=precision, flash_attention=flash_attention, recompute_share=share,
                                    ep=plan.expert_parallel, ep_channel=ep_channel,
                                    etp=plan.expert_tensor_parallel)
        return costs[key]

    # Simulate each distinct replica once; record when every stage's last backward ends.
    sims: dict[tuple[object, ...], tuple[list[float], list[float], PipelineTimes, list[tuple[float, ...]]]] = {}
    keys = []
    for r in plan.replicas:
        key = (tuple(_stage_key(st) for st in r.stages), r.num_micro_batches)
        if key not in sims:
            shared = (plan.schedule, v, mbs, precision, sp, s_len, flash_attention, recompute_mode,
                      tuple(st.chunk_layers for st in r.stages), key)
            if simulations is not None and shared in simulations:
                sims[key] = simulations[shared]
            else:
                sims[key] = _simulate(plan, r, model, cluster, cost, seq_length=s_len, profile=profile)
                if simulations is not None:
                    simulations[shared] = sims[key]
        keys.append(key)
    # Reduction peers of a stage: in every replica, the stage holding its first layer.
    holders: dict[int, list[tuple[str, float, int]]] = {}
    # A tied word embedding (GPT recipe) is held by every replica's first stage and, where the pipeline
    # has more than one stage, by its last stage's copy: one gradient group across both (runtime/grad_sync.py),
    # whatever their islands, ending after the last of their backwards.
    tied = not model.untie_embeddings_and_output_weights
    embedding_holders: list[tuple[str, float, int]] = []
    embedding_tps: list[int] = []
    for r, key in zip(plan.replicas, keys):
        ends = sims[key][2].stage_end
        for st, end in zip(r.stages, ends):
            for layer in range(st.layers[0], st.layers[1]):
                holders.setdefault(layer, []).append((st.island, end, st.ranks[0]))
        if tied:
            for i in dict.fromkeys((0, len(r.stages) - 1)):
                embedding_holders.append((r.stages[i].island, ends[i], r.stages[i].ranks[0]))
                embedding_tps.append(r.stages[i].tp)
    # one-stage replicas only: the embedding's group is the first stages' own (nothing apart to price)
    multi_stage = any(len(r.stages) > 1 for r in plan.replicas)
    # holders of different TP sizes take grad_sync's reshard path: every TP rank of every holder
    # all-reduces the full (vocab x hidden) buffer; equal sizes: one group per TP rank over its rows
    embedding_reshard = len(set(embedding_tps)) > 1
    if embedding_reshard:
        embedding_group = [(isl, end, r0 + k) for (isl, end, r0), tp in zip(embedding_holders, embedding_tps)
                           for k in range(tp)]
    else:
        embedding_group = embedding_holders
    reductions: dict[tuple[object, ...], tuple[float, float, float]] = {}

    def reduce_and_step(stage: StagePlan, is_first: bool, is_last: bool, bwd_s: float) -> tuple[float, float, float]:
        """(reduction seconds, when the reduction ends, optimizer seconds) of one stage."""
        key = (_stage_key(stage), is_first, is_last)
        if key not in reductions:
            params = stage_parameters(model, num_layers=stage.num_layers, is_first=is_first, is_last=is_last,
                                      ep=plan.expert_parallel, etp=plan.expert_tensor_parallel,
                                      tp=stage.tp)
            # the tied embedding's rows, reduced with the other stage that holds them (priced below)
            embedding = (word_embedding_parameters_per_rank(model, tp=stage.tp)
                         if tied and (is_first or is_last) and multi_stage else 0)
            params -= embedding
            peers = holders[stage.layers[0]]
            names = [name for name, _, _ in peers]
            start = max(end for _, end, _ in peers)  # every peer must be done with its backward
            island_of = cluster.island(stage.island)
            node = stage.ranks[0] // island_of.gpus_per_node

            def group_all_reduce_s(nbytes: float, group: list[tuple[str, float, int]]) -> float:
                same_node = sum(1 for name, _, r0 in group
                                if name == stage.island and r0 // island_of.gpus_per_node == node)
                return dp_gradient_reduction(nbytes, cluster, replica_islands=[name for name, _, _ in group],
                                             ranks_per_node=max(1, same_node)).total_s

            # distributed optimizer: reduce-scatter the gradients (half a ring all-reduce; across
            # collective libraries maybe a whole sharded one: distributed_optimizer_share); the
            # updated weights' all-gather overlaps the next forward with overlap_grad_reduce
            # (--overlap-param-gather), else it follows the optimizer step (added to the tail here).
            # Once per stage: reduce_s runs per gradient bucket.
            def group_reduce_s(n: int, group: list[tuple[str, float, int]]) -> float:
                group_names = [name for name, _, _ in group]
                share = distributed_optimizer_share(cluster, replica_islands=group_names) if dist_opt else 1.0
                bridged = bucket_all_stages and spans_collective_libraries(cluster, group_names)
                if dist_opt and plan.overlap_grad_reduce:  # the runtime's all-reduce buckets (module docstring)
                    gather = share * group_all_reduce_s(param_bytes * n, group) if bridged else 0.0
                    return group_all_reduce_s(grad_bytes * n, group) + gather
                if dist_opt:
                    rs = share * group_all_reduce_s(grad_bytes * n, group)
                    return rs if overlap_grad_reduce else rs + share * group_all_reduce_s(param_bytes * n, group)
                return group_all_reduce_s(grad_bytes * n, group)

            def reduce_s(n: int) -> float:
                return group_reduce_s(n, peers)

            bridged = bucket_all_stages and spans_collective_libraries(cluster, names)

            red = reduce_s(params) if dp > 1 else 0.0
            tail = red
            overlapped = dp > 1 and overlap_grad_reduce and (is_first or bucket_all_stages) and v == 1 and not bridged
            if overlapped:
                chunks = stage_gradient_chunks(model, cost(stage), num_layers=stage.num_layers, is_first=is_first,
                                               is_last=is_last, tp=stage.tp, tied_elsewhere=embedding > 0)
                tail = overlapped_reduction_tail_s(chunks, backward_s=bwd_s, bucket_params=bucket_parameters(dp),
                                                   reduce_s=reduce_s)
            end = start + tail
            island = cluster.island(stage.island)
            shard = len(peers) if dist_opt else 1
            opt_params = params // shard
            if embedding:  # its own group, after the last of its holders' backwards: not hidden, and on the
                # same network as this stage's own reductions. Overlapped, those run during the backward
                # and the embedding's follows what is left of them; in the plain synchronizer every bucket
                # waits for the backward and they run one after the other (grad_sync orders the buckets by
                # their ranks: the embedding's, holding the first stages' ranks, usually comes first)
                e_numel = model.vocab_size * model.hidden_size if embedding_reshard else embedding
                e_red = group_reduce_s(e_numel, embedding_group)
                red += e_red
                e_start = max(t for _, t, _ in embedding_holders)
                end = (max(end, e_start) if overlapped else max(start, e_start) + tail) + e_red
                opt_params += embedding // (len(embedding_holders) if dist_opt else 1)
            opt = cluster.slowdown(stage.island) * optimizer_step_s(island.device, opt_params, profile=profile,
                                                                        precision=precision, island=stage.island)
            reductions[key] = (red, end, opt)
        return reductions[key]

    built: dict[tuple[object, ...], ReplicaPrediction] = {}
    replicas = []
    for r, key in zip(plan.replicas, keys):
        if key not in built:
            built[key] = _replica(plan, r, model, cluster, sims[key], reduce_and_step, dp=dp, dist_opt=dist_opt,
                                  seq_length=s_len, flash_attention=flash_attention, recompute_mode=recompute_mode,
                                  profile=profile)
        replicas.append(built[key])

    pipeline = max(r.pipeline_time_s for r in replicas)
    reduced = max(s.gradient_reduction_end_s for r in replicas for s in r.stages)
    reduction = max(0.0, reduced - pipeline)
    optimizer = max(s.optimizer_s for r in replicas for s in r.stages)
    gpus = plan.world_size
    sync = SYNC_ALL_REDUCES_PER_ITERATION * small_all_reduce_s(cluster, gpus, profile=profile,
                                                               islands=[st.island for r in plan.replicas
                                                                        for st in r.stages])
    iteration = pipeline + reduction + sync + optimizer
    flops = model_flops_per_iteration(model, global_batch_size=plan.global_batch_size, seq_length=s_len)
    return Prediction(
        iteration_time_s=iteration, pipeline_time_s=pipeline, gradient_reduction_s=reduction, optimizer_s=optimizer,
        synchronization_s=sync,
        tokens_per_s=plan.global_batch_size * s_len / iteration,
        tflops_per_gpu=flops / (iteration * gpus) / 1e12, num_gpus=gpus,
        memory_gib_per_rank_max=max(s.memory_gib for r in replicas for s in r.stages),
        fits=all(s.fits for r in replicas for s in r.stages), replicas=tuple(replicas),
    )


def _simulate(plan: Plan, r: ReplicaPlan, model: ModelSpec, cluster: ClusterSpec, cost, *, seq_length: int,
              profile: Profile | Sequence[Profile] | None = None,
              ) -> tuple[list[float], list[float], PipelineTimes, list[tuple[float, ...]]]:
    """Per-stage forward and backward seconds per micro-batch, the simulated schedule and the stages' ends."""
    p, m, v = len(r.stages), r.num_micro_batches, plan.virtual_pipeline_size
    fwd, bwd, ends = [], [], []
    for i, st in enumerate(r.stages):
        c = cost(st)
        fwd.append(c.forward_s(st.num_layers, is_first=i == 0, is_last=i == p - 1))
        bwd.append(c.backward_s(st.num_layers, is_first=i == 0, is_last=i == p - 1))
        ends.append(stage_ends(c, is_first=i == 0, is_last=i == p - 1))
    split = [backward_split_shares(profile, cluster.island(st.island).device.name, st.island) for st in r.stages]
    overhead = stage_call_overheads(r, v, profile, cluster)
    for i, st in enumerate(r.stages):  # v calls per micro-batch, not the 1/n of one per layer the entries hold
        of, ob, n = call_overhead_s(profile, cluster.island(st.island).device.name, st.island)
        fwd[i] += v * of - st.num_layers * of / n
        bwd[i] += v * ob - st.num_layers * ob / n
    duration = action_duration(plan, r, fwd, bwd, ends=ends, split=split, overhead=overhead)
    p2p = hop_time(plan, r, model, cluster, seq_length=seq_length)

    # duration and p2p depend on the stage and the action kind only: any micro-batch count costs the same
    return fwd, bwd, pipeline_times(plan.schedule, p, m, v, duration, p2p), ends


def stage_call_overheads(r: ReplicaPlan, v: int, profile: Profile | Sequence[Profile] | None,
                         cluster: ClusterSpec) -> list[tuple[float, float]]:
    """Per stage: (forward, backward) seconds each model-chunk call costs beyond its layers."""
    return [call_overhead_s(profile, cluster.island(st.island).device.name, st.island)[:2] for st in r.stages]


def stage_ends(cost: StageCost, *, is_first: bool, is_last: bool) -> tuple[float, float, float, float]:
    """(embedding forward, embedding backward, output forward, output backward) seconds inside a stage's
    forward/backward: the parts only its first / last model chunk runs."""
    return ((cost.embedding_forward_s, cost.embedding_backward_s) if is_first else (0.0, 0.0)) + (
        (cost.output_forward_s, cost.output_backward_s) if is_last else (0.0, 0.0))


def action_duration(plan: Plan, r: ReplicaPlan, fwd: list[float], bwd: list[float],
                    ends: Sequence[tuple[float, float, float, float]] | None = None,
                    split: Sequence[tuple[float, float]] | None = None,
                    overhead: Sequence[tuple[float, float]] | None = None):
    """(stage, action) -> seconds: a chunk's share of its stage's layer time is its share of the stage's
    layers; the embedding (``ends[stage][:2]``) is its first chunk's and the output layer + loss
    (``ends[stage][2:]``) its last chunk's alone; with a split backward B and W take ``split[stage]``
    (B's, W's share of the fused backward; default half each; measured: ``backward_split_shares``).
    ``overhead[stage]``: (forward, backward) seconds every chunk's call costs whatever its layers
    (``call_overhead_s``; included V times in ``fwd``/``bwd``), charged once per action.
    Shared by the prediction and ``replica_trace`` (what ``predict --trace`` renders)."""
    is_split = plan.schedule in SPLIT_BACKWARD_SCHEDULES
    shares = [(0.5, 0.5)] * len(r.stages) if split is None else list(split)
    chunks = chunk_layers(r, plan.virtual_pipeline_size)
    share = [[(b - a) / st.num_layers for a, b in ch] for st, ch in zip(r.stages, chunks)]
    ends = [(0.0, 0.0, 0.0, 0.0)] * len(r.stages) if ends is None else list(ends)
    overhead = [(0.0, 0.0)] * len(r.stages) if overhead is None else list(overhead)
    v = plan.virtual_pipeline_size

    def duration(stage: int, action: Action) -> float:
        c, last = action.chunk, len(share[stage]) - 1
        ef, eb, of, ob = ends[stage]
        cf, cb = overhead[stage]
        # interleaved: measured on the last stage, its last chunk's F/B took 1.3x a layer-share of the
        # stage's time (it alone runs the output layer + loss), its first chunk 0.93x (bench/schedules_gap.py)
        if action.kind == "F":
            return ((fwd[stage] - ef - of - v * cf) * share[stage][c] + cf + (ef if c == 0 else 0.0)
                    + (of if c == last else 0.0))
        b = ((bwd[stage] - eb - ob - v * cb) * share[stage][c] + cb + (eb if c == 0 else 0.0)
             + (ob if c == last else 0.0))
        if not is_split:
            return b
        return b * shares[stage][0 if action.kind == "B" else 1]

    return duration


def hop_time(plan: Plan, r: ReplicaPlan, model: ModelSpec, cluster: ClusterSpec, *, seq_length: int):
    """(src stage, dst stage, action) -> seconds of the boundary transfer (either direction, wrap-around included)."""
    p, mbs = len(r.stages), plan.micro_batch_size
    hop: dict[tuple[int, int], float] = {}
    for a in range(p):
        for b in ((a + 1) % p, (a - 1) % p):
            if a == b or (a, b) in hop:
                continue
            sa, sb = r.stages[a], r.stages[b]
            nbytes = activation_message_bytes(model, micro_batch_size=mbs, seq_length=seq_length,
                                              tp=sa.tp, sequence_parallel=plan.sequence_parallel,
                                              element_bytes=activation_element_bytes(plan.precision))
            same = sa.island == sb.island and _same_node(cluster.island(sa.island), sa, sb)
            hop[(a, b)] = p2p_time(nbytes, cluster, src=sa.island, dst=sb.island, same_node=same)

    def p2p(src: int, dst: int, action: Action) -> float:
        return hop.get((src, dst), 0.0)

    return p2p


def replica_trace(plan: Plan, replica: int, model: ModelSpec, cluster: ClusterSpec, prediction: Prediction, *,
                  seq_length: int | None = None):
    """The simulated timeline (schedule.SimResult) of one replica: the action lists the runtime executes
    (``build_schedule`` of the plan's schedule), timed with the prediction's per-stage costs."""
    from megatron_het.schedule import build_schedule, simulate

    r = plan.replicas[replica]
    stages = prediction.replicas[replica].stages
    duration = action_duration(plan, r, [s.forward_s for s in stages], [s.backward_s for s in stages],
                               ends=[s.ends_s for s in stages], split=[s.backward_split for s in stages],
                               overhead=[s.call_overhead_s for s in stages])
    p2p = hop_time(plan, r, model, cluster, seq_length=model.seq_length if seq_length is None else seq_length)
    return simulate(build_schedule(plan.schedule, len(r.stages), r.num_micro_batches, plan.virtual_pipeline_size),
                    duration, p2p)


def plan_stage_memory(plan: Plan, r: ReplicaPlan, i: int, model: ModelSpec, cluster: ClusterSpec, *, dp: int,
                      distributed_optimizer: bool, seq_length: int, flash_attention: bool | None = None,
                      recompute_mode: str | None = None, recompute_num_layers: int | None = None) -> StageMemory:
    """Memory on one rank of stage ``i`` of replica ``r`` as :func:`predict` prices it (its peak
    micro-batches in flight under the plan's schedule); ``recompute_num_layers`` overrides the stage's
    (planner.block_recompute tries counts with it)."""
    st, p, m, v = r.stages[i], len(r.stages), r.num_micro_batches, plan.virtual_pipeline_size
    in_flight = m if plan.schedule == "gpipe" else microbatches_in_flight(
        stage=i, pipeline_size=p, num_microbatches=m, virtual_stages=v)
    mem = stage_memory(model, num_layers=st.num_layers, is_first=i == 0, is_last=i == p - 1,
                       ep=plan.expert_parallel, etp=plan.expert_tensor_parallel,
                       micro_batch_size=plan.micro_batch_size, microbatches_in_flight=in_flight, tp=st.tp, dp=dp,
                       seq_length=seq_length, sequence_parallel=plan.sequence_parallel,
                       recompute=(recompute_mode or "full") if st.recompute else "none",
                       distributed_optimizer=distributed_optimizer, precision=plan.precision,
                       flash_attention=next(f for f in (flash_attention, fused_attention(plan.attention),
                                                        not cluster.island(st.island).device.is_host)
                                            if f is not None),
                       virtual_stages=v, recompute_num_layers=(st.recompute_num_layers if recompute_num_layers is None
                                                               else recompute_num_layers),
                       chunk_sizes=plan_chunk_sizes(plan, r, i))
    if plan.overlap_grad_reduce and dp > 1:
        # the runtime's overlapped buckets (runtime/overlap_grad.py) pack each bucket's gradients into a
        # flat buffer at launch and keep it until reduce() unpacks it after the backward: at the peak every
        # bucket's copy beside the gradients themselves
        mem = replace(mem, gradients_bytes=2 * mem.gradients_bytes)
    return mem


def _replica(plan: Plan, r: ReplicaPlan, model: ModelSpec, cluster: ClusterSpec,
             simulated: tuple[list[float], list[float], PipelineTimes, list[tuple[float, ...]]], reduce_and_step, *, dp: int, dist_opt: bool,
             seq_length: int, flash_attention: bool | None = None, recompute_mode: str | None = None,
             profile: Profile | Sequence[Profile] | None = None) -> ReplicaPrediction:
    p, m, v = len(r.stages), r.num_micro_batches, plan.virtual_pipeline_size
    fwd, bwd, sim, ends = simulated
    stages = []
    for i, st in enumerate(r.stages):
        is_first, is_last = i == 0, i == p - 1
        mem = plan_stage_memory(plan, r, i, model, cluster, dp=dp, distributed_optimizer=dist_opt,
                                seq_length=seq_length, flash_attention=flash_attention, recompute_mode=recompute_mode)
        red, red_end, opt = reduce_and_step(st, is_first, is_last, bwd[i] / v)
        device = cluster.island(st.island).device
        stages.append(StagePrediction(
            island=st.island, device_type=st.device_type, tp=st.tp, layers=st.layers, forward_s=fwd[i],
            backward_s=bwd[i], compute_s=sim.busy[i], idle_s=sim.idle[i], gradient_reduction_s=red,
            gradient_reduction_end_s=red_end, optimizer_s=opt, memory=mem, capacity_gib=device_capacity_bytes(device) / _GIB,
            ends_s=tuple(ends[i]), backward_split=backward_split_shares(profile, device.name, st.island),
            call_overhead_s=call_overhead_s(profile, device.name, st.island)[:2],
        ))
    return ReplicaPrediction(num_micro_batches=m, pipeline_time_s=sim.iteration_time,
                             bubble_fraction=sim.bubble_fraction, stages=tuple(stages))
