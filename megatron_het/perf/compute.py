"""Compute time of a transformer layer on a device type, analytic or from a measured profile.

The analytic model (docs/performance-model.md, "Compute model") prices each kernel a layer runs:

- **GEMMs** by their three dimensions. A GEMM ``[m, k] @ [k, n]`` (``batch`` of them) is cut into
  thread-block tiles ``tm x tn``; the tiles run in waves over the device's SMs/CUs
  (``DeviceType.compute_units``), so a GEMM of 109 tiles on 108 SMs takes two waves (wave
  quantisation); edge tiles are partly empty (padding); a short reduction depth ``k`` leaves the
  tile's main loop little work to hide its prologue and epilogue (``k / (k + k_half)``). cuBLAS and
  hipBLASLt pick among several tile shapes, so the model takes the best of a few candidates, smaller
  tiles paying their lower arithmetic intensity. The result scales the calibrated large-GEMM
  efficiency (``gemm_efficiency``, a fraction of the device's dense rate at the run's precision);
  a memory roofline bounds it from below. Backward runs the two GEMMs of the chain rule with their
  own shapes: input gradient ``[m, n] @ [n, k]`` and weight gradient ``[k, m] @ [m, n]``.
- **Attention core**: unfused (Megatron's masked-softmax path, or megatron-core's local spec on CPU)
  as two batched GEMMs plus the ``s x s`` softmax and dropout traffic; or fused (flash) attention,
  one kernel at ``attention_efficiency`` of the 16-bit rate on the causal half of the score FLOPs,
  backward 2.5x the forward (five GEMM-like products instead of two).
- **Element-wise work** (norms, bias + dropout + residual, activation, fp8 casts) is memory bound:
  bytes at ``memory_efficiency`` of the device bandwidth.
- **Every kernel** pays ``kernel_overhead_us`` (launch, ramp-up, tail): negligible for large layers,
  dominant for small hidden sizes and micro-batches.

Parameters come, in order, from a profile's ``compute_model`` (tools/calibrate.py writes one), the
calibrated defaults (perf/calibrated.py, the fit of bench/published.py's data set, inputs in
examples/published/), or a vendor prior (:data:`PRIORS`). The older efficiency curve
(``EfficiencyCurve``: ``e_max * m / (m + m_half)`` on the smallest dimension) is kept for callers that
pass ``curve=``.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from megatron_het.cluster import AMD, HOST, NVIDIA, ConfigError, DeviceType, ModelSpec
from megatron_het.perf.calibrated import CALIBRATED
from megatron_het.perf.flops import (
    BACKWARD_TO_FORWARD,
    Gemm,
    Recompute,
    check_recompute,
    check_tp,
    layer_gemms,
    logits_gemm,
    mlp_widths,
    padded_vocab_size,
)
from megatron_het.perf.kernels import PRECISION_CLASSES, TILE_SHAPES, ComputeParams, precision_class
from megatron_het.perf.memory import activation_element_bytes
from megatron_het.perf.profile import Profile, layer_shape, lookup, lookup_part

__all__ = [
    "PRECISION_CLASSES",
    "TILE_SHAPES",
    "EfficiencyCurve",
    "DEFAULT_EFFICIENCY",
    "ComputeParams",
    "PRIORS",
    "precision_class",
    "compute_params_for",
    "gemm_efficiency",
    "LayerTimes",
    "efficiency_curve_for",
    "gemm_time",
    "layer_elementwise_bytes",
    "layer_times",
    "logits_times",
    "embedding_times",
]


@dataclass(frozen=True, kw_only=True)
class EfficiencyCurve:
    """Fraction of peak a GEMM reaches as a function of its smallest dimension (the older model)."""

    e_max: float  # asymptotic fraction of peak for very large GEMMs, in (0, 1]
    m_half: float  # smallest dimension at which half of e_max is reached

    def __post_init__(self) -> None:
        if not 0 < self.e_max <= 1:
            raise ConfigError("must be in (0, 1]", field="e_max", value=self.e_max,
                              fix="give the large-GEMM fraction of peak, e.g. 0.7")
        if not self.m_half > 0:
            raise ConfigError("must be > 0", field="m_half", value=self.m_half,
                              fix="give the GEMM size at half efficiency, e.g. 128")

    def efficiency(self, smallest_dim: int) -> float:
        return self.e_max * smallest_dim / (smallest_dim + self.m_half)


DEFAULT_EFFICIENCY: Mapping[str, EfficiencyCurve] = types.MappingProxyType({
    NVIDIA: EfficiencyCurve(e_max=0.7, m_half=128.0),
    AMD: EfficiencyCurve(e_max=0.6, m_half=256.0),
    HOST: EfficiencyCurve(e_max=0.5, m_half=32.0),
})

# Vendor priors: what the model assumes before any fit. Documented guesses, replaced per device type
# by perf/calibrated.py (the fit of published runs) or a profile's compute_model.
PRIORS: Mapping[str, Mapping[str, ComputeParams]] = types.MappingProxyType({
    NVIDIA: types.MappingProxyType({
        "16bit": ComputeParams(gemm_efficiency=0.8, attention_efficiency=0.5, kernel_overhead_us=6.0,
                               source="prior: cuBLAS large bf16 GEMMs ~80% of dense peak"),
        "fp8": ComputeParams(gemm_efficiency=0.6, attention_efficiency=0.5, kernel_overhead_us=6.0,
                             source="prior"),
        "tf32": ComputeParams(gemm_efficiency=0.7, attention_efficiency=0.5, kernel_overhead_us=6.0,
                              source="prior"),
        "fp32": ComputeParams(gemm_efficiency=0.85, attention_efficiency=0.5, kernel_overhead_us=6.0,
                              source="prior"),
    }),
    AMD: types.MappingProxyType({
        "16bit": ComputeParams(gemm_efficiency=0.6, attention_efficiency=0.35, kernel_overhead_us=10.0,
                               source="prior: hipBLASLt saturates lower than cuBLAS"),
        "fp8": ComputeParams(gemm_efficiency=0.5, attention_efficiency=0.35, kernel_overhead_us=10.0,
                             source="prior"),
        "tf32": ComputeParams(gemm_efficiency=0.55, attention_efficiency=0.35, kernel_overhead_us=10.0,
                              source="prior"),
        "fp32": ComputeParams(gemm_efficiency=0.7, attention_efficiency=0.35, kernel_overhead_us=10.0,
                              source="prior"),
    }),
    HOST: types.MappingProxyType({
        c: ComputeParams(gemm_efficiency=0.5, attention_efficiency=0.3, kernel_overhead_us=0.0, memory_efficiency=1.0,
                         source="prior: nominal CPU, priced with the smallest-dimension curve (use a "
                                "measured profile: tools/profile_host.py)")
        for c in PRECISION_CLASSES
    }),
})


def compute_params_for(device: DeviceType, precision: str = "bf16", *,
                       profile: Profile | None = None) -> ComputeParams:
    """The kernel figures used for ``device`` at ``precision``: the profile's fitted ones, else the
    calibrated defaults, else the vendor prior."""
    cls = precision_class(precision)
    if profile is not None and cls in profile.compute_model:
        return profile.compute_model[cls]
    return _default_params(device.name, device.vendor, cls)


@functools.lru_cache(maxsize=256)
def _default_params(name: str, vendor: str, cls: str) -> ComputeParams:
    fitted = CALIBRATED.get(name, {}).get(cls)
    if fitted is not None:
        return ComputeParams(**fitted)
    return PRIORS[vendor][cls]


@dataclass(frozen=True, kw_only=True)
class LayerTimes:
    """Seconds one rank spends on one micro-batch of a layer (or the embedding/output layer)."""

    forward_s: float  # forward pass
    backward_s: float  # backward pass, including any recomputation it triggers
    source: str  # "analytic" or "profile:<file or device>", so predictions can be explained
    includes_tp_comm: bool = False  # measured with its TP collectives: do not add modelled TP traffic
    # an MoE layer measured over several ranks: the (EP, expert-TP) of the measurement, whose token-dispatcher
    # traffic (over the links measured on) is in the times; None: none is (perf.predict.stage_cost adds it)
    moe_grid: tuple[int, int] | None = None
    # forward + backward seconds by part ("gemm:qkv", "attention", "elementwise", "kernel_overhead",
    # "recompute", ...) when analytic; empty for measured times.
    parts: Mapping[str, float] = field(default_factory=dict)


def efficiency_curve_for(device: DeviceType) -> EfficiencyCurve:
    return DEFAULT_EFFICIENCY[device.vendor]


def _bytes_per_s(device: DeviceType) -> float:
    return device.memory_bandwidth_gbs * 1e9


def gemm_efficiency(gemm: Gemm, device: DeviceType, params: ComputeParams) -> float:
    """Fraction of the dense rate this GEMM shape reaches: calibrated large-GEMM efficiency times the
    best tile shape's wave, padding and reduction-depth utilisation."""
    m, n, k, batch = gemm.m, gemm.n, gemm.k, gemm.batch
    units = device.compute_units
    best = 0.0
    for tm, tn, shape_eff in TILE_SHAPES:
        tiles_m, tiles_n = -(-m // tm), -(-n // tn)
        tiles = tiles_m * tiles_n * batch
        wave = 1.0 if not units else tiles / (-(-tiles // units) * units)
        pad = (m * n) / (tiles_m * tm * tiles_n * tn)
        best = max(best, shape_eff * wave * pad)
    return params.gemm_efficiency * best * k / (k + params.k_half)


def gemm_time(gemm: Gemm, device: DeviceType, *, curve: EfficiencyCurve | None = None, precision: str = "bf16",
              params: ComputeParams | None = None) -> float:
    """Forward seconds of one GEMM (one kernel): fixed cost + compute at the shape's efficiency, or
    the memory time if longer. With ``curve`` the older smallest-dimension curve is used instead."""
    elem = {"fp32": 4, "tf32": 4, "fp8": 1}.get(precision, 2)
    memory = gemm.bytes_moved * elem / 2 / _bytes_per_s(device)
    if curve is not None:
        compute = gemm.flops / (device.rate_tflops(precision) * 1e12 * curve.efficiency(gemm.smallest_dim))
        return max(compute, memory)
    params = params or compute_params_for(device, precision)
    compute = gemm.flops / (device.rate_tflops(precision) * 1e12 * gemm_efficiency(gemm, device, params))
    return params.kernel_overhead_s + max(compute, memory)


def _backward_gemms(g: Gemm) -> tuple[Gemm, Gemm]:
    """Input gradient ``[m, n] @ [n, k]`` and weight gradient ``[k, m] @ [m, n]`` of ``g``."""
    return (replace(g, m=g.m, n=g.k, k=g.n), replace(g, m=g.k, n=g.n, k=g.m))


def _attention_core_elementwise_bytes(heads: int, s: int, b: int) -> int:
    # scale+mask+softmax: read and write 2 bytes; dropout: read 2, write 2, mask 1.
    return (4 + 5) * heads * s * s * b


def layer_elementwise_bytes(model: ModelSpec, *, micro_batch_size: int, seq_length: int | None = None,
                            tp: int = 1, sequence_parallel: bool = False, flash_attention: bool = False,
                            precision: str = "bf16") -> int:
    """Bytes the memory-bound parts of one layer's forward move on one rank (16-bit elements; fp32
    and tf32 runs move twice as much).

    Two norms (read + write, 4 bytes/element), softmax and attention dropout, two fused
    bias-dropout-add (read input and residual, write output, write mask: 7 bytes/element) and the
    activation (gelu: read f, write f; swiglu: read 2f, write f). Norm and residual regions hold
    ``s/t`` tokens with sequence parallelism. A fused (flash) attention kernel keeps the
    ``s x s`` softmax in on-chip memory, so that traffic is dropped.
    """
    check_tp(model, tp)
    b = micro_batch_size
    s = model.seq_length if seq_length is None else seq_length
    s_local = s // tp if sequence_parallel else s
    h, f, heads = model.hidden_size, mlp_widths(model)[0] // tp, model.num_attention_heads // tp
    norms_and_residuals = (2 * 4 + 2 * 7) * s_local * b * h
    activation = (6 if model.swiglu else 4) * s * b * f
    core = 0 if flash_attention else _attention_core_elementwise_bytes(heads, s, b)
    return (norms_and_residuals + activation + core) * activation_element_bytes(precision) // 2


def _analytic_layer(model: ModelSpec, device: DeviceType, *, micro_batch_size: int, s: int, tp: int,
                    sequence_parallel: bool, flash_attention: bool, precision: str,
                    params: ComputeParams, curve: EfficiencyCurve | None) -> tuple[float, float, float, dict]:
    """(forward, backward, attention-core forward, parts) seconds of one layer, analytic (memoised:
    the planner prices the same layer many times)."""
    fwd, bwd, core, parts = _analytic_layer_cached(model, device, micro_batch_size, s, tp, sequence_parallel,
                                                   flash_attention, precision, params, curve)
    return fwd, bwd, core, dict(parts)


@functools.lru_cache(maxsize=8192)
def _analytic_layer_cached(model: ModelSpec, device: DeviceType, micro_batch_size: int, s: int, tp: int,
                           sequence_parallel: bool, flash_attention: bool, precision: str,
                           params: ComputeParams, curve: EfficiencyCurve | None) -> tuple[float, float, float, tuple]:
    gemms = layer_gemms(model, micro_batch_size=micro_batch_size, seq_length=s, tp=tp)
    bw = _bytes_per_s(device) * params.memory_efficiency
    overhead = params.kernel_overhead_s
    parts: dict[str, float] = {}
    fwd = bwd = core_fwd = 0.0
    heads = model.num_attention_heads // tp
    gemm_precision = precision
    for g in gemms:
        core = g.name.startswith("attention_")
        if core and flash_attention:
            continue
        # the attention core's batched GEMMs stay 16-bit in fp8 runs (Transformer Engine)
        p = "bf16" if (core and precision == "fp8") else gemm_precision
        cp = params if p == precision else compute_params_for(device, p)
        f = gemm_time(g, device, curve=curve, precision=p, params=cp)
        b = sum(gemm_time(x, device, curve=curve, precision=p, params=cp) for x in _backward_gemms(g))
        if curve is not None:  # older model: no fixed cost inside, backward twice the forward
            b = BACKWARD_TO_FORWARD * f
        key = "gemm:attention" if core else f"gemm:{g.name}"
        parts[key] = parts.get(key, 0.0) + f + b - (0 if curve is not None else 3 * overhead)
        parts["kernel_overhead"] = parts.get("kernel_overhead", 0.0) + (0 if curve is not None else 3 * overhead)
        fwd, bwd = fwd + f, bwd + b
        if core:
            core_fwd += f
        if precision == "fp8" and not core:
            # Transformer Engine casts the GEMM's activation input to fp8 in forward and the output
            # gradient in backward with cast_transpose: read 2 bytes, write the fp8 copy and its
            # transpose (Hopper's fp8 GEMMs take only the TN layout, so the gradient GEMMs need the
            # transposed copy), 4 bytes per element. The inputs of QKV and fc1 come out of their norm
            # already in fp8 when the norm is fused with the GEMM (LayerNormLinear): only the
            # transpose is left (read 1, write 1). Weights are cast once per iteration (Megatron
            # passes is_first_microbatch), not per micro-batch, and are not counted.
            fused = params.fused_norm_casts and g.name in ("qkv", "fc1")
            cast_f = (2 if fused else 4) * g.m * g.k * g.batch / bw + overhead
            cast_b = 4 * g.m * g.n * g.batch / bw + overhead
            fwd, bwd = fwd + cast_f, bwd + cast_b
            parts["fp8_casts"] = parts.get("fp8_casts", 0.0) + cast_f + cast_b
    if flash_attention:
        sixteen = device.rate_tflops("bf16" if precision in ("fp8", "fp16", "bf16") else precision)
        flops = 4 * micro_batch_size * heads * s * s * model.kv_channels * 0.5  # causal half of QK^T and PV
        # attention_efficiency is a fraction of the 16-bit rate in every precision class (the fused
        # kernel stays 16-bit in fp8 runs), so the run's own figures price it (a profile's too)
        f = overhead + flops / (sixteen * 1e12 * params.attention_efficiency)
        b = overhead + 2.5 * (f - overhead)
        fwd, bwd, core_fwd = fwd + f, bwd + b, core_fwd + f
        parts["attention"] = parts.get("attention", 0.0) + f + b - 2 * overhead
        parts["kernel_overhead"] = parts.get("kernel_overhead", 0.0) + 2 * overhead
    else:
        core_bytes = _attention_core_elementwise_bytes(heads, s, micro_batch_size) \
            * activation_element_bytes(precision) // 2
        core_fwd += core_bytes / bw + 2 * overhead
    elementwise = layer_elementwise_bytes(model, micro_batch_size=micro_batch_size, seq_length=s, tp=tp,
                                          sequence_parallel=sequence_parallel, flash_attention=flash_attention,
                                          precision=precision) / bw
    n_kernels = params.elementwise_kernels + (0 if flash_attention else 2)
    fwd += elementwise + n_kernels * overhead
    bwd += BACKWARD_TO_FORWARD * (elementwise + n_kernels * overhead)
    parts["elementwise"] = parts.get("elementwise", 0.0) + 3 * elementwise
    parts["kernel_overhead"] = parts.get("kernel_overhead", 0.0) + 3 * n_kernels * overhead
    return fwd, bwd, core_fwd, tuple(parts.items())


def layer_times(model: ModelSpec, device: DeviceType, *, micro_batch_size: int, seq_length: int | None = None,
                tp: int = 1, sequence_parallel: bool = False, recompute: Recompute = "none",
                flash_attention: bool | None = None, curve: EfficiencyCurve | None = None,
                profile: Profile | None = None, precision: str = "bf16",
                params: ComputeParams | None = None, ep: int = 1) -> LayerTimes:
    """Forward and backward seconds of one layer for one micro-batch on one rank.

    If ``profile`` (measured on this device type; the caller picks it) has an entry for this layer
    shape and ``tp``, its interpolated times are used; otherwise the analytic model (with the
    profile's fitted ``compute_model`` when it has one). Full recomputation adds a forward to the
    backward; selective adds the attention core. ``flash_attention`` None: fused on GPUs (what
    megatron-core's Transformer Engine spec runs), unfused on CPUs (the local spec). ``ep``: an MoE
    layer's expert-parallel size (expert-TP 1); an entry measured over that many ranks is taken, else the
    EP 1 entry, which stands for the compute (a rank runs as many routed token copies under any EP);
    ``moe_grid`` says which dispatcher traffic the times hold, and the caller adds the rest.
    """
    check_recompute(recompute)
    if flash_attention is None:
        flash_attention = not device.is_host
    s = model.seq_length if seq_length is None else seq_length
    params = params or compute_params_for(device, precision, profile=profile)
    curve = curve or _cpu_curve(device, profile)
    fwd_a, bwd_a, core, parts = _analytic_layer(model, device, micro_batch_size=micro_batch_size, s=s, tp=tp,
                                                sequence_parallel=sequence_parallel,
                                                flash_attention=flash_attention, precision=precision,
                                                params=params, curve=curve)
    measured = None if profile is None or not profile.entries else lookup(
        profile, **layer_shape(model), seq_length=s, tp=tp, micro_batch_size=micro_batch_size, ep=ep)
    if measured is None and ep > 1 and profile is not None and profile.entries:  # the all-to-all then modelled
        measured = lookup(profile, **layer_shape(model), seq_length=s, tp=tp, micro_batch_size=micro_batch_size)
    base = None if measured is not None or profile is None or not profile.entries or tp == 1 else lookup(
        profile, **layer_shape(model), seq_length=s, tp=1, micro_batch_size=micro_batch_size)
    includes_comm, moe_grid = False, None
    if measured is not None:
        forward, backward = measured.forward_s, measured.backward_s
        source = f"profile:{profile.source or profile.device}"
        includes_comm = measured.includes_tp_comm
        if model.is_moe and (measured.tp > 1 or measured.ep > 1):  # expert-TP = TP at EP 1, else 1
            moe_grid = (measured.ep, measured.tp if measured.ep == 1 else 1)
        parts = {}
    elif base is not None:  # measured unsplit: scale to this TP size by the analytic model's ratio
        whole = _analytic_layer(model, device, micro_batch_size=micro_batch_size, s=s, tp=1,
                                sequence_parallel=sequence_parallel, flash_attention=flash_attention,
                                precision=precision, params=params, curve=curve)
        forward = base.forward_s * fwd_a / whole[0]
        backward = base.backward_s * bwd_a / whole[1]
        core = core * forward / fwd_a
        source = f"profile:{profile.source or profile.device} (tp=1, scaled to tp={tp} analytically)"
        parts = {}
    else:
        forward, backward = fwd_a, bwd_a
        source = "analytic"
    extra = {"none": 0.0, "full": forward, "selective": core}[recompute]
    if parts and extra:
        parts = dict(parts, recompute=extra)
    return LayerTimes(forward_s=forward, backward_s=backward + extra, source=source, includes_tp_comm=includes_comm,
                      moe_grid=moe_grid, parts=types.MappingProxyType(parts))


def _cpu_curve(device: DeviceType, profile: Profile | None) -> EfficiencyCurve | None:
    """CPUs have no tiles or waves: without a fitted compute_model they keep the smallest-dimension
    curve (and a measured profile is what prices them)."""
    if device.is_host and not (profile is not None and profile.compute_model):
        return efficiency_curve_for(device)
    return None


def _measured_part(part: str, analytic, model: ModelSpec, *, micro_batch_size: int, seq_length: int | None,
                   tp: int, profile: Profile | None) -> LayerTimes:
    """A part's measured times (scaled from tp=1 by the analytic ratio when only that was measured),
    or the analytic ones."""
    here = analytic(tp)
    if profile is None or not profile.parts:
        return here
    s = model.seq_length if seq_length is None else seq_length
    shape = dict(hidden_size=model.hidden_size, vocab_size=padded_vocab_size(model.vocab_size), seq_length=s,
                 micro_batch_size=micro_batch_size)
    measured = lookup_part(profile, part, tp=tp, **shape)
    scale_f = scale_b = 1.0
    if measured is None and tp > 1:
        measured = lookup_part(profile, part, tp=1, **shape)
        one = analytic(1)
        scale_f, scale_b = here.forward_s / one.forward_s, here.backward_s / one.backward_s
    if measured is None:
        return here
    return LayerTimes(forward_s=measured.forward_s * scale_f, backward_s=measured.backward_s * scale_b,
                      source=f"profile:{profile.source or profile.device}")


def logits_times(model: ModelSpec, device: DeviceType, *, micro_batch_size: int, seq_length: int | None = None,
                 tp: int = 1, curve: EfficiencyCurve | None = None, profile: Profile | None = None,
                 precision: str = "bf16", params: ComputeParams | None = None) -> LayerTimes:
    """Output layer GEMM (16-bit in fp8 runs) plus the fp32 cross entropy over the rank's vocabulary
    shard (about three passes over ``4*s*b*V/t`` bytes: upcast, softmax, gradient); measured "output"
    part of ``profile`` (final norm, logits, cross entropy) when it has one for this shape."""
    p = "bf16" if precision == "fp8" else precision
    params = params if params is not None and p == precision else compute_params_for(device, p, profile=profile)
    curve = curve or _cpu_curve(device, profile)

    def analytic(t: int) -> LayerTimes:
        gemm = logits_gemm(model, micro_batch_size=micro_batch_size, seq_length=seq_length, tp=t)
        bw = _bytes_per_s(device) * params.memory_efficiency
        cross_entropy = 3 * 4 * gemm.m * gemm.n / bw + 3 * params.kernel_overhead_s
        f_gemm = gemm_time(gemm, device, curve=curve, precision=p, params=params)
        b_gemm = (BACKWARD_TO_FORWARD * f_gemm if curve is not None else
                  sum(gemm_time(x, device, precision=p, params=params) for x in _backward_gemms(gemm)))
        forward = f_gemm + cross_entropy
        backward = BACKWARD_TO_FORWARD * forward if curve is not None else b_gemm + cross_entropy
        return LayerTimes(forward_s=forward, backward_s=backward, source="analytic",
                          parts=types.MappingProxyType({"gemm:logits": f_gemm + b_gemm,
                                                       "elementwise": 2 * cross_entropy}))

    return _measured_part("output", analytic, model, micro_batch_size=micro_batch_size, seq_length=seq_length,
                          tp=tp, profile=profile)


def embedding_times(model: ModelSpec, device: DeviceType, *, micro_batch_size: int,
                    seq_length: int | None = None, tp: int = 1, profile: Profile | None = None,
                    precision: str = "bf16") -> LayerTimes:
    """Embedding gather (read + write ``s*b*h`` elements) and its scatter-add backward; measured
    "embedding" part of ``profile`` when it has one for this shape."""
    s = model.seq_length if seq_length is None else seq_length
    params = compute_params_for(device, precision, profile=profile)
    elem = activation_element_bytes(precision)

    def analytic(t: int) -> LayerTimes:  # the gathered activation is whole on every TP rank
        forward = 2 * elem * s * micro_batch_size * model.hidden_size / _bytes_per_s(device)
        forward = forward / params.memory_efficiency + params.kernel_overhead_s
        return LayerTimes(forward_s=forward, backward_s=BACKWARD_TO_FORWARD * forward, source="analytic",
                          parts=types.MappingProxyType({"elementwise": 3 * forward}))

    return _measured_part("embedding", analytic, model, micro_batch_size=micro_batch_size, seq_length=seq_length,
                          tp=tp, profile=profile)
