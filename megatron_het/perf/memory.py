"""Device memory of one rank of a pipeline stage: weights, gradients, optimizer, activations.

Model state (mixed precision with Adam, as Megatron-LM's DDP + optimizer keep it):
- bf16 weights, 2 bytes/param; fp32 main gradients, 4 bytes/param (Megatron's DDP accumulates and
  reduces in fp32 by default); fp32 master weights + Adam's two moments, 12 bytes/param.
- That is 18 bytes/param, or ``6 + 12/d`` with the distributed optimizer, which shards only the
  optimizer part over the ``d`` data-parallel replicas. Source: Megatron Core developer guide,
  "Distributed Optimizer", table of theoretical bytes per parameter ("bf16 param, fp32 grads:
  18 | 6 + 12/d"), https://docs.nvidia.com/megatron-core/developer-guide/latest/distrib_optimizer.html
- The same table gives the other precisions (:data:`STATE_BYTES`): ``--fp16`` keeps fp16 gradients
  and the optimizer holds fp32 main params and main grads besides the moments ("fp16 param, fp16
  grads: 20 | 4 + 16/d"); fp32 (and tf32, which differs only in matmul precision) has no master copy
  ("fp32 param, fp32 grads: 16 | 8 + 8/d"). fp8 (Transformer Engine) keeps bf16 weights and fp32
  main gradients, as bf16. Activations are 4 bytes per element in fp32/tf32, 2 otherwise (fp8
  runs keep their saved activations in bf16; the fp8 copies TE caches are not counted).

Activations (16-bit, stored for backward), Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", sections 4.1-4.3. Per layer and micro-batch:
``s*b*h*(34 + 5*a*s/h)`` bytes without parallelism; ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` with
tensor parallelism; ``s*b*h/t*(34 + 5*a*s/h)`` with sequence parallelism as well; selective
recomputation drops the ``5*a*s/h`` (attention core) term; full recomputation keeps only the layer
input, ``2*s*b*h`` (``/t`` with sequence parallelism). We evaluate the same derivation term by term
on the real shapes, so GQA (smaller K, V), swiglu (two fc1 halves) and ``ffn != 4h`` are exact
generalisations that reduce to the paper's formulas for a GPT shape (tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_het.cluster import ConfigError, DeviceType, ModelSpec
from megatron_het.perf.flops import (
    Recompute,
    check_recompute,
    check_tp,
    mlp_widths,
    routed_expert_parameters_per_rank,
    stage_parameters,
)

__all__ = [
    "STATE_BYTES",
    "state_bytes",
    "activation_element_bytes",
    "PARAM_BYTES",
    "GRAD_BYTES",
    "OPTIMIZER_BYTES",
    "DEFAULT_OVERHEAD_BYTES",
    "StageMemory",
    "activation_bytes_per_layer",
    "first_stage_extra_activation_bytes",
    "last_stage_extra_activation_bytes",
    "microbatches_in_flight",
    "stage_memory",
    "device_capacity_bytes",
    "optimizer_shard_weights",
    "unsharded_expert_parameters",
    "runtime_attention",
    "runtime_state_bytes",
    "rank_memory",
]

PARAM_BYTES = 2  # bf16 model weights
GRAD_BYTES = 4  # fp32 main gradients in Megatron's DDP buffer
OPTIMIZER_BYTES = 12  # fp32 master weights + Adam exp_avg + exp_avg_sq
DEFAULT_OVERHEAD_BYTES = int(1.5 * 2**30)  # CUDA context, cuBLAS/NCCL workspaces, allocator slack

# precision -> (weight, gradient, optimizer) bytes per parameter (Megatron's distributed optimizer table).
STATE_BYTES = {
    "fp32": (4, 4, 8), "tf32": (4, 4, 8), "fp16": (2, 2, 16), "bf16": (PARAM_BYTES, GRAD_BYTES, OPTIMIZER_BYTES),
    "fp8": (2, 4, 12),
}


def state_bytes(precision: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter at ``precision``."""
    if precision not in STATE_BYTES:
        raise ConfigError("unknown precision", field="precision", value=precision,
                          fix=f"use one of: {', '.join(STATE_BYTES)}")
    return STATE_BYTES[precision]


def activation_element_bytes(precision: str) -> int:
    """Bytes of one stored activation element: 4 in fp32/tf32, 2 in 16-bit and fp8 runs."""
    state_bytes(precision)
    return 4 if precision in ("fp32", "tf32") else 2


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """Bytes one rank of a stage needs at its peak, split so a planner can say what overflowed."""

    parameters_bytes: int  # bf16 weights of the stage's share of the model on this rank
    gradients_bytes: int  # fp32 main-gradient buffer
    optimizer_bytes: int  # fp32 master weights + Adam moments (sharded over dp if distributed)
    activations_bytes: int  # activations of all micro-batches in flight at the peak
    overhead_bytes: int  # fixed framework overhead (context, workspaces)

    @property
    def total_bytes(self) -> int:
        return sum(self.parts().values())

    def parts(self) -> dict[str, int]:
        """Part name -> bytes, in a fixed order."""
        return {
            "parameters": self.parameters_bytes,
            "gradients": self.gradients_bytes,
            "optimizer": self.optimizer_bytes,
            "activations": self.activations_bytes,
            "overhead": self.overhead_bytes,
        }

    def largest_part(self) -> str:
        parts = self.parts()
        return max(parts, key=parts.__getitem__)

    def fits(self, capacity_bytes: int) -> bool:
        return self.total_bytes <= capacity_bytes


def device_capacity_bytes(device: DeviceType) -> int:
    """Device memory in bytes (the catalog gives GiB)."""
    return int(device.memory_gib * 2**30)


def _check_sp(model: ModelSpec, seq_length: int, tp: int, sequence_parallel: bool) -> None:
    if sequence_parallel and seq_length % tp:
        raise ConfigError(f"sequence parallelism needs seq_length divisible by tp={tp}", field="seq_length",
                          value=seq_length, fix=f"use a sequence length that is a multiple of {tp}, "
                                                "or turn sequence parallelism off")


def activation_bytes_per_layer(model: ModelSpec, *, micro_batch_size: int, seq_length: int | None = None,
                               tp: int = 1, sequence_parallel: bool = False,
                               recompute: Recompute = "none", flash_attention: bool = False,
                               precision: str = "bf16", dropout: bool = True, fused_softmax: bool = True) -> int:
    """Activation bytes one layer keeps for backward, per micro-batch, on one TP rank.

    Terms (Korthikanti et al. 2022, sec. 4.1; ``x`` = s*b*h elements, 2 bytes each unless a mask):
    outside the TP region: two norm inputs (2x each), QKV input (2x), fc1 input (2x), two dropout
    masks (1x each) -> 10x, split over t only with sequence parallelism; inside it: Q, K, V and the
    projection input, the activation input (``2*s*b*f``, twice for swiglu) and the fc2 input
    (``2*s*b*f``), and the attention core, ``5*a*s^2*b`` (softmax output 2, dropout mask 1,
    dropout output 2), which selective recomputation does not store. A fused (flash) attention
    kernel stores no ``s x s`` tensors either, only fp32 softmax statistics, ``4*a*s*b`` bytes
    (megatron-core's local spec, what runs on CPU, uses the unfused path). In fp32/tf32 every
    element but the dropout masks takes 4 bytes instead of 2. ``dropout=False`` (hidden and attention
    dropout 0, what the pipeline runtime builds: ``model/gpt.transformer_config``) stores neither the
    two masks nor the attention-dropout mask and output: torch's dropout at p=0 returns its input.
    ``fused_softmax=False`` is megatron-core's torch fallback (no fused kernel: CPU): in 16-bit runs it
    computes the softmax in fp32 (``attention_softmax_in_fp32``) and keeps that fp32 output for its
    backward besides the 16-bit copy the next matmul saves, ``4*a*s^2*b`` bytes more.
    """
    check_tp(model, tp)
    check_recompute(recompute)
    b = micro_batch_size
    s = model.seq_length if seq_length is None else seq_length
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        raise ConfigError("must be an integer >= 1", field="micro_batch_size", value=b,
                          fix="pass a positive micro-batch size")
    _check_sp(model, s, tp, sequence_parallel)
    h, d = model.hidden_size, model.kv_channels
    s_local = s // tp if sequence_parallel else s  # sequence-parallel regions hold s/t tokens
    e = activation_element_bytes(precision)
    if recompute == "full":
        return e * s_local * b * h  # only the layer input survives the forward
    heads = model.num_attention_heads // tp
    groups = model.num_query_groups // tp
    f = mlp_widths(model)[0] // tp  # MoE: the routed experts' widths each token runs through
    masks = 2 if dropout else 0
    outside = (4 * e + masks) * s_local * b * h  # 4 tensors (2 norm inputs, QKV and fc1 inputs) + 2 masks
    attention = e * s * b * (2 * heads * d + 2 * groups * d)  # Q and projection input; K and V
    mlp = e * s * b * (f * (2 if model.swiglu else 1) + f)  # activation input; fc2 input
    if model.is_moe:  # the dispatcher's permuted copy of the tokens (gathered over TP), one per routed expert
        mlp += e * s * b * h * model.moe_router_topk
    if recompute == "selective":
        core = 0
    elif flash_attention:
        core = 4 * heads * s * b
    else:
        core = ((2 * e + 1) if dropout else e) * heads * s * s * b  # softmax output, dropout output, dropout mask
        if not fused_softmax and e == 2:
            core += 4 * heads * s * s * b  # the fallback's fp32 softmax output
    return outside + attention + mlp + core


def first_stage_extra_activation_bytes(model: ModelSpec, *, micro_batch_size: int, seq_length: int | None = None,
                                       tp: int = 1, sequence_parallel: bool = False, precision: str = "bf16") -> int:
    """Embedding dropout mask, ``s*b*h`` bytes (``/t`` with sequence parallelism); Korthikanti sec. 4.3."""
    activation_element_bytes(precision)
    s = model.seq_length if seq_length is None else seq_length
    _check_sp(model, s, tp, sequence_parallel)
    s_local = s // tp if sequence_parallel else s
    return s_local * micro_batch_size * model.hidden_size


def last_stage_extra_activation_bytes(model: ModelSpec, *, micro_batch_size: int, seq_length: int | None = None,
                                      tp: int = 1, sequence_parallel: bool = False, precision: str = "bf16") -> int:
    """Final norm input and output-layer input (2 bytes each) plus fp32 logits for the
    cross entropy, ``4*s*b*V/t``: ``4*s*b*h/t*(1 + V/h)`` with sequence parallelism (sec. 4.3)."""
    check_tp(model, tp)
    s = model.seq_length if seq_length is None else seq_length
    _check_sp(model, s, tp, sequence_parallel)
    s_local = s // tp if sequence_parallel else s
    b, h = micro_batch_size, model.hidden_size
    e = activation_element_bytes(precision)
    return 2 * e * s_local * b * h + 4 * s * b * math.ceil(model.vocab_size / tp)


def microbatches_in_flight(*, stage: int, pipeline_size: int, num_microbatches: int, virtual_stages: int = 1) -> int:
    """Micro-batches (model chunks x micro-batches with interleaving) whose activations stage
    ``stage`` (0-based) holds at its peak.

    1F1B: ``min(p - i, m)`` (warm-up forwards plus the one in steady state). Interleaved with ``v``
    chunks per stage, Megatron's warm-up is ``2*(p - i - 1) + (v - 1)*p`` chunk-forwards, so the
    peak is ``min(2*(p - i - 1) + (v - 1)*p + 1, m*v)`` chunk micro-batches, each holding ``1/v`` of
    the stage's layers; for stage 0 that is ``1 + (p - 1)/(p*v)`` times the 1F1B figure.
    """
    for name, value, low in (("pipeline_size", pipeline_size, 1), ("num_microbatches", num_microbatches, 1),
                             ("virtual_stages", virtual_stages, 1), ("stage", stage, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"must be an integer >= {low}", field=name, value=value, fix=f"pass {name} >= {low}")
    if stage >= pipeline_size:
        raise ConfigError(f"must be < pipeline_size ({pipeline_size})", field="stage", value=stage,
                          fix=f"use a stage index from 0 to {pipeline_size - 1}")
    if virtual_stages == 1:
        return min(pipeline_size - stage, num_microbatches)
    warmup = 2 * (pipeline_size - stage - 1) + (virtual_stages - 1) * pipeline_size
    return min(warmup + 1, num_microbatches * virtual_stages)


def plan_chunk_sizes(plan, replica, stage: int) -> tuple[int, ...] | None:
    """Layers of each model chunk of ``replica``'s stage ``stage`` under an interleaved ``plan`` (the
    plan's uneven chunk_layers, else an even split); None without virtual stages."""
    if plan.virtual_pipeline_size == 1:
        return None
    from megatron_het.plan import chunk_layers

    return tuple(b - a for a, b in chunk_layers(replica, plan.virtual_pipeline_size)[stage])


def stage_memory(model: ModelSpec, *, num_layers: int, is_first: bool, is_last: bool, micro_batch_size: int,
                 microbatches_in_flight: int, tp: int = 1, dp: int = 1, seq_length: int | None = None,
                 sequence_parallel: bool = False, recompute: Recompute = "none",
                 distributed_optimizer: bool = True, virtual_stages: int = 1, flash_attention: bool = False,
                 overhead_bytes: int = DEFAULT_OVERHEAD_BYTES, precision: str = "bf16",
                 dropout: bool = True, fused_softmax: bool = True, recompute_num_layers: int = 0,
                 chunk_sizes: tuple[int, ...] | None = None, ep: int = 1, etp: int | None = None) -> StageMemory:
    """Peak bytes on one rank of a stage of ``num_layers`` layers.

    ``chunk_sizes``: the layers of each of the stage's ``virtual_stages`` chunks when a plan splits
    them unevenly (StagePlan.chunk_layers); each in-flight chunk micro-batch is then charged the
    largest chunk's layers (an upper bound: which chunk a micro-batch in flight belongs to is left out).

    ``microbatches_in_flight`` comes from :func:`microbatches_in_flight` (chunk micro-batches when
    ``virtual_stages > 1``; each then holds ``num_layers / virtual_stages`` layers). The first and
    last stage extras are charged per in-flight micro-batch of the whole stage. With recomputation,
    one layer's full activations are added for the layer being recomputed during backward; with
    ``recompute_num_layers`` N > 0 only the first N layers of each chunk recompute (Megatron's block
    method), the others keep their full activations. Weight, gradient and optimizer bytes per
    parameter and activation element sizes follow ``precision``. ``ep``/``etp``: an MoE plan's expert
    grid (plan/experts.py); the routed experts' optimizer state is then counted unsharded (an upper
    bound: their holders are fewer than the replicas).
    """
    weight_b, grad_b, opt_b = state_bytes(precision)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ConfigError("must be an integer >= 1", field="dp", value=dp, fix="pass the number of replicas (>= 1)")
    if chunk_sizes is not None and (len(chunk_sizes) != virtual_stages or sum(chunk_sizes) != num_layers):
        raise ConfigError(f"{len(chunk_sizes)} chunks of {sum(chunk_sizes)} layers for virtual_stages={virtual_stages} "
                          f"and num_layers={num_layers}", field="chunk_sizes", value=list(chunk_sizes),
                          fix="give one layer count per virtual stage, adding up to the stage's layers")
    if virtual_stages < 1 or (chunk_sizes is None and num_layers % virtual_stages):
        raise ConfigError(f"num_layers={num_layers} does not split into virtual_stages={virtual_stages} chunks",
                          field="virtual_stages", value=virtual_stages,
                          fix="use a number of virtual stages that divides the stage's layer count")
    if microbatches_in_flight < 1:
        raise ConfigError("must be >= 1", field="microbatches_in_flight", value=microbatches_in_flight,
                          fix="use microbatches_in_flight() to compute it")
    if overhead_bytes < 0:
        raise ConfigError("must be >= 0", field="overhead_bytes", value=overhead_bytes,
                          fix="pass the framework overhead in bytes, e.g. 1.5 GiB = 1610612736")
    params = stage_parameters(model, num_layers=num_layers, is_first=is_first, is_last=is_last, tp=tp, ep=ep, etp=etp)
    shard = dp if distributed_optimizer else 1
    experts = unsharded_expert_parameters(model, num_layers=num_layers, tp=tp, ep=ep, etp=etp)
    per_layer = activation_bytes_per_layer(model, micro_batch_size=micro_batch_size, seq_length=seq_length, tp=tp,
                                           sequence_parallel=sequence_parallel, recompute=recompute,
                                           flash_attention=flash_attention, precision=precision, dropout=dropout,
                                           fused_softmax=fused_softmax)
    # Layer-micro-batches alive at the peak: chunk micro-batches x layers per chunk.
    chunk = max(chunk_sizes) if chunk_sizes is not None else num_layers // virtual_stages
    recomputed = min(recompute_num_layers, chunk) if recompute != "none" and recompute_num_layers > 0 else chunk
    activations = microbatches_in_flight * recomputed * per_layer
    if recomputed < chunk:  # block method: the chunk's later layers store everything
        activations += microbatches_in_flight * (chunk - recomputed) * activation_bytes_per_layer(
            model, micro_batch_size=micro_batch_size, seq_length=seq_length, tp=tp,
            sequence_parallel=sequence_parallel, flash_attention=flash_attention, precision=precision,
            dropout=dropout, fused_softmax=fused_softmax)
    whole_stage_mbs = math.ceil(microbatches_in_flight / virtual_stages)
    extras = dict(model=model, micro_batch_size=micro_batch_size, seq_length=seq_length, tp=tp,
                  sequence_parallel=sequence_parallel, precision=precision)
    if is_first and dropout:  # the embedding dropout mask
        activations += whole_stage_mbs * first_stage_extra_activation_bytes(**extras)
    last_extra = last_stage_extra_activation_bytes(**extras) if is_last else 0
    activations += whole_stage_mbs * last_extra
    if recompute != "none" and recomputed:
        # Backward re-runs one layer's forward at a time, so one layer's stored activations
        # (without recomputation) are alive on top of what the stage keeps; by then the micro-batch's
        # output-layer activations (last stage) and, under the block method, the full activations of
        # the chunk's later layers (backwarded first) have been freed: the peak is the larger of the
        # forward's and this.
        full = activation_bytes_per_layer(model, micro_batch_size=micro_batch_size, seq_length=seq_length,
                                          tp=tp, sequence_parallel=sequence_parallel,
                                          flash_attention=flash_attention, precision=precision,
                                          dropout=dropout, fused_softmax=fused_softmax)
        activations += max(0, full - per_layer - last_extra - (chunk - recomputed) * full)
    return StageMemory(
        parameters_bytes=weight_b * params,
        gradients_bytes=grad_b * params,
        optimizer_bytes=math.ceil(opt_b * (params - experts) / shard) + opt_b * experts,
        activations_bytes=activations,
        overhead_bytes=overhead_bytes,
    )


def unsharded_expert_parameters(model: ModelSpec, *, num_layers: int, tp: int = 1, ep: int = 1,
                                etp: int | None = None) -> int:
    """A stage rank's routed-expert parameters whose optimizer state the model counts whole (not split
    over the replicas) under an expert grid (EP > 1 or an expert-TP of its own): the distributed optimizer
    shards it over the expert's holders only, fewer than the replicas; an upper bound. 0 otherwise.
    The planner's estimate and :func:`stage_memory` both keep it apart."""
    if not model.is_moe or (ep == 1 and etp is None):
        return 0
    return num_layers * routed_expert_parameters_per_rank(model, tp=tp, ep=ep, etp=etp)


def optimizer_shard_weights(model: ModelSpec, plan, *, precision: str | None = None) -> dict[int, float]:
    """Rank -> memory left for optimizer state (the distributed optimizer's share weights).

    Free memory is the rank's device capacity (catalog, by the stage's ``device_type``) minus what
    :func:`stage_memory` predicts for everything but the optimizer state (weights, gradients,
    activations at the peak of the schedule the runtime executes, with the plan's virtual stages,
    as :func:`rank_memory` counts them; with ``overlap_grad_reduce`` the buckets' packed gradient
    copies, as the predictor counts them; overhead), floored at 1% of the capacity so every holder
    keeps a share (``precision``: the run's, default the plan's). Pure: every rank computes the
    same weights from the same plan. A plan naming a device
    type the catalog does not have (a cluster file's own ``device_types:``) gets equal weights: the
    runtime does not read the cluster file's definitions here.
    """
    from megatron_het.cluster.catalog import CATALOG
    from megatron_het.schedule import build_schedule

    if any(st.device_type not in CATALOG for r in plan.replicas for st in r.stages):
        return {rank: 1.0 for r in plan.replicas for rank in r.ranks}
    precision = precision or plan.precision
    out: dict[int, float] = {}
    v = plan.virtual_pipeline_size
    peaks: dict[tuple[int, int], tuple[int, ...]] = {}  # (stages, micro-batches) -> per-stage peak in flight
    for replica in plan.replicas:
        p, m = len(replica.stages), replica.num_micro_batches
        if (p, m) not in peaks:
            peaks[p, m] = tuple(build_schedule(plan.schedule, p, m, v).peak_in_flight())
        for i, st in enumerate(replica.stages):
            capacity = device_capacity_bytes(CATALOG[st.device_type])
            mem = stage_memory(model, num_layers=st.num_layers, is_first=i == 0, is_last=i == p - 1,
                               ep=plan.expert_parallel, etp=plan.expert_tensor_parallel,
                               micro_batch_size=plan.micro_batch_size, microbatches_in_flight=peaks[p, m][i],
                               tp=st.tp, sequence_parallel=plan.sequence_parallel,
                               recompute="full" if st.recompute else "none", distributed_optimizer=False,
                               virtual_stages=v, precision=precision, recompute_num_layers=st.recompute_num_layers,
                               dropout=False, **runtime_attention(plan, st),  # as rank_memory
                               chunk_sizes=plan_chunk_sizes(plan, replica, i))
            copies = mem.gradients_bytes if plan.overlap_grad_reduce else 0  # runtime/overlap_grad.py's packed buckets
            free = capacity - (mem.total_bytes - mem.optimizer_bytes) - copies
            for r in st.ranks:
                out[r] = float(max(free, capacity // 100))
    return out


def runtime_attention(plan, stage) -> dict[str, bool]:
    """The attention the pipeline runtime builds for ``stage`` of ``plan``, as ``stage_memory``'s
    arguments: the plan's kernel (``Plan.attention``; without it fused on GPUs, unfused on hosts, as the
    runtime chooses), and on a host megatron-core's unfused softmax."""
    from megatron_het.cluster.catalog import CATALOG
    from megatron_het.plan.types import fused_attention

    host = stage.device_type in CATALOG and CATALOG[stage.device_type].is_host
    fused = fused_attention(plan.attention)
    return {"fused_softmax": not host, "flash_attention": not host if fused is None else fused}


def runtime_state_bytes(precision: str, *, distributed_optimizer: bool) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter the *pipeline runtime* keeps, optimizer bytes
    before sharding (divide by the holders' share with the distributed optimizer).

    fp32/tf32: weights 4, ``.grad`` 4, Adam moments 8 (with the distributed optimizer the parameters
    are the main values: Megatron's ``8 + 8/d``). bf16 and fp16 (the runtime treats both alike:
    ``MainParams`` / ``MainGrads``): weights 2, fp32 main gradients 4, fp32 main values + moments 12
    (Megatron's bf16 ``6 + 12/d``; its fp16 row keeps fp16 gradients too, this runtime does not).
    """
    state_bytes(precision)
    if precision in ("fp32", "tf32"):
        return 4, 4, 8
    if precision == "fp8":
        raise ConfigError("the pipeline runtime has no fp8 path", field="precision", value=precision,
                          fix="use fp32, bf16 or fp16")
    return 2, 4, 12


def _holder_shares(model: ModelSpec, plan, rank: int, weights: dict[int, float]) -> dict[str, float]:
    """Fraction of each parameter class's local elements rank ``rank`` owns with the distributed
    optimizer (``optim/holders.py``: every element split among its holders by weight)."""
    from megatron_het.plan import rank_roles

    role = rank_roles(plan)[rank]
    w = weights[rank]
    first, stop = role.layers

    def stage_of(replica, layer):
        for st in replica.stages:
            if st.layers[0] <= layer < st.layers[1]:
                return st
        raise ValueError(f"layer {layer}: no stage of the replica holds it")

    def share(stages, replicated: bool) -> float:
        total = sum(weights[st.ranks[0]] * (st.tp if replicated else 1) for st in stages)
        return w / total

    out = {}
    layers = range(first, stop)
    out["layer_partitioned"] = sum(share([stage_of(r, l) for r in plan.replicas], False) for l in layers) / max(
        len(layers), 1)
    out["layer_replicated"] = sum(share([stage_of(r, l) for r in plan.replicas], True) for l in layers) / max(
        len(layers), 1)
    firsts = [r.stages[0] for r in plan.replicas]
    lasts = [r.stages[-1] for r in plan.replicas]
    tied = not model.untie_embeddings_and_output_weights
    word = firsts + ([r.stages[-1] for r in plan.replicas if len(r.stages) > 1] if tied else [])
    out["word_embedding"] = share(word, False)
    out["position_embedding"] = share(firsts, True)
    out["final_norm"] = share(lasts, True)
    out["output_layer"] = share(lasts, False)
    return out


def rank_memory(model: ModelSpec, plan, rank: int, *, precision: str | None = None, padded_vocab: int | None = None,
                dropout: bool = False, weights: dict[int, float] | None = None) -> StageMemory:
    """What the pipeline runtime holds on ``rank`` of ``plan``, by component, at its peak.

    The same components ``runtime/memory_report.py`` measures: parameters, gradients and optimizer
    state from :func:`runtime_state_bytes` over the rank's parameters (padded vocabulary:
    ``padded_vocab`` or the model's own), optimizer state split as ``optim/holders.py`` splits it
    when the plan's ``use_distributed_optimizer`` is on (``weights``: the runtime's
    :func:`optimizer_shard_weights` unless given); activations from :func:`stage_memory` with the
    in-flight micro-batches of the schedule the runtime executes (``Schedule.peak_in_flight``: GPipe
    all of the replica's, 1F1B ``min(p - i, m)``, interleaved and zero-bubble from their action lists)
    and the stage's recompute setting; ``dropout`` False is what the runtime builds; a host device type (CPU)
    runs megatron-core's unfused softmax; the attention kernel is the plan's (``Plan.attention``; without
    the field fused on GPUs, unfused on hosts, as the runtime builds it). No overhead term.
    """
    import dataclasses as _dc

    from megatron_het.perf.flops import (
        _learned_positions,
        _norm_params,
        layer_parameters_per_rank,
        replicated_layer_parameters,
        routed_expert_parameters_per_rank,
    )
    from megatron_het.plan import rank_roles
    from megatron_het.schedule import build_schedule

    precision = precision or plan.precision
    role = rank_roles(plan)[rank]
    replica = plan.replicas[role.replica]
    st = replica.stages[role.stage]
    p, i, m = len(replica.stages), role.stage, replica.num_micro_batches
    is_first, is_last = i == 0, i == p - 1
    vmodel = _dc.replace(model, vocab_size=padded_vocab) if padded_vocab else model
    tp, h = st.tp, model.hidden_size
    weight_b, grad_b, opt_b = runtime_state_bytes(precision, distributed_optimizer=plan.use_distributed_optimizer)
    replicated_per_layer = replicated_layer_parameters(model)
    ep, etp = plan.expert_parallel, plan.expert_tensor_parallel
    per_layer = layer_parameters_per_rank(vmodel, tp=tp, ep=ep, etp=etp)
    n_layers = st.num_layers
    # expert parallelism: this rank's routed experts, whose optimizer state is counted whole (an upper
    # bound: the distributed optimizer shards it over the expert's holders, fewer than the layer's)
    experts = (n_layers * routed_expert_parameters_per_rank(vmodel, tp=tp, ep=ep, etp=etp)
               if model.is_moe and (ep > 1 or etp is not None) else 0)
    classes = {"layer_partitioned": n_layers * (per_layer - replicated_per_layer) - experts,
               "experts": experts,
               "layer_replicated": n_layers * replicated_per_layer,
               "word_embedding": (vmodel.vocab_size // tp) * h if (is_first or (is_last and not
                                                                   model.untie_embeddings_and_output_weights)) else 0,
               "position_embedding": (model.max_position_embeddings or model.seq_length) * h
               if is_first and _learned_positions(model) else 0,
               "final_norm": _norm_params(model) if is_last else 0,
               "output_layer": (vmodel.vocab_size // tp) * h if is_last and model.untie_embeddings_and_output_weights
               else 0}
    params = sum(classes.values())
    if plan.use_distributed_optimizer:
        shares = _holder_shares(model, plan, rank, weights or optimizer_shard_weights(model, plan,
                                                                                     precision=precision))
        optimizer = sum(opt_b * n * shares.get(k, 1.0) for k, n in classes.items())
    else:
        optimizer = opt_b * params
    # in-flight (chunk) micro-batches from the schedule the runtime executes (the same data)
    in_flight = build_schedule(plan.schedule, p, m, plan.virtual_pipeline_size).peak_in_flight()[i]
    act = stage_memory(vmodel, num_layers=n_layers, is_first=is_first, is_last=is_last, ep=ep, etp=etp,
                       micro_batch_size=plan.micro_batch_size, microbatches_in_flight=in_flight, tp=tp,
                       sequence_parallel=plan.sequence_parallel, recompute="full" if st.recompute else "none",
                       virtual_stages=plan.virtual_pipeline_size, precision=precision, overhead_bytes=0,
                       dropout=dropout, **runtime_attention(plan, st),
                       recompute_num_layers=st.recompute_num_layers,
                       chunk_sizes=plan_chunk_sizes(plan, replica, i)).activations_bytes
    return StageMemory(parameters_bytes=weight_b * params, gradients_bytes=grad_b * params,
                       optimizer_bytes=int(round(optimizer)), activations_bytes=act, overhead_bytes=0)
