"""Compute time of a transformer layer on a device type, analytic or from a measured profile.

GEMMs follow a roofline with a size-dependent efficiency:
``t = max(flops / (peak * eff(m)), bytes / memory_bandwidth)``, where ``m`` is the GEMM's
smallest dimension and ``eff(m) = e_max * m / (m + m_half)`` rises from 0 and saturates at
``e_max`` (small tiles leave tensor cores idle and are launch/latency bound). Element-wise work
(norms, softmax, dropout, activation, bias + residual) is memory bound: ``bytes / bandwidth``.
Backward is twice the forward for both kinds (two GEMMs per forward GEMM; element-wise backward
reads the saved input and the incoming gradient and writes a gradient).

The per-vendor curve defaults are rough, documented guesses meant to be replaced by a profile
(``tools/profile_host.py``): NVIDIA cuBLAS reaches ~70% of dense peak on large bf16 GEMMs and half of
that near m=128; AMD (rocBLAS/hipBLASLt) saturates lower and later; CPUs (oneDNN/MKL) saturate
early but far below their nominal peak.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_het.cluster import ConfigError, DeviceType, ModelSpec
from megatron_het.perf.flops import (
    BACKWARD_TO_FORWARD,
    Gemm,
    Recompute,
    check_recompute,
    check_tp,
    layer_gemms,
    logits_gemm,
    padded_vocab_size,
)
from megatron_het.perf.profile import Profile, lookup, lookup_part

__all__ = [
    "EfficiencyCurve",
    "DEFAULT_EFFICIENCY",
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
    """Fraction of peak a GEMM reaches as a function of its smallest dimension."""

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
    "nvidia": EfficiencyCurve(e_max=0.7, m_half=128.0),
    "amd": EfficiencyCurve(e_max=0.6, m_half=256.0),
    "cpu": EfficiencyCurve(e_max=0.5, m_half=32.0),
})


@dataclass(frozen=True, kw_only=True)
class LayerTimes:
    """Seconds one rank spends on one micro-batch of a layer (or the embedding/output layer)."""

    forward_s: float  # forward pass
    backward_s: float  # backward pass, including any recomputation it triggers
    source: str  # "analytic" or "profile:<file or device>", so predictions can be explained
    includes_tp_comm: bool = False  # measured with its TP collectives: do not add modelled TP traffic


def efficiency_curve_for(device: DeviceType) -> EfficiencyCurve:
    return DEFAULT_EFFICIENCY[device.vendor]


def _bytes_per_s(device: DeviceType) -> float:
    return device.memory_bandwidth_gbs * 1e9


def gemm_time(gemm: Gemm, device: DeviceType, *, curve: EfficiencyCurve | None = None) -> float:
    """Forward seconds of one GEMM: compute time at the curve's efficiency, or memory time if longer."""
    curve = curve or efficiency_curve_for(device)
    compute = gemm.flops / (device.peak_tflops * 1e12 * curve.efficiency(gemm.smallest_dim))
    return max(compute, gemm.bytes_moved / _bytes_per_s(device))


def _attention_core_elementwise_bytes(heads: int, s: int, b: int) -> int:
    # scale+mask+softmax: read and write 2 bytes; dropout: read 2, write 2, mask 1.
    return (4 + 5) * heads * s * s * b


def layer_elementwise_bytes(model: ModelSpec, *, micro_batch_size: int, seq_length: int | None = None,
                            tp: int = 1, sequence_parallel: bool = False, flash_attention: bool = False) -> int:
    """bf16 bytes the memory-bound parts of one layer's forward move on one rank.

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
    h, f, heads = model.hidden_size, model.ffn_hidden_size // tp, model.num_attention_heads // tp
    norms_and_residuals = (2 * 4 + 2 * 7) * s_local * b * h
    activation = (6 if model.swiglu else 4) * s * b * f
    core = 0 if flash_attention else _attention_core_elementwise_bytes(heads, s, b)
    return norms_and_residuals + activation + core


def layer_times(model: ModelSpec, device: DeviceType, *, micro_batch_size: int, seq_length: int | None = None,
                tp: int = 1, sequence_parallel: bool = False, recompute: Recompute = "none",
                flash_attention: bool = False, curve: EfficiencyCurve | None = None,
                profile: Profile | None = None) -> LayerTimes:
    """Forward and backward seconds of one layer for one micro-batch on one rank.

    If ``profile`` (measured on this device type; the caller picks it) has an entry for this layer
    shape and ``tp``, its interpolated times are used; otherwise the analytic model. Full
    recomputation adds a forward to the backward; selective adds the attention core.
    """
    check_recompute(recompute)
    s = model.seq_length if seq_length is None else seq_length
    gemms = layer_gemms(model, micro_batch_size=micro_batch_size, seq_length=s, tp=tp)
    bw = _bytes_per_s(device)
    heads = model.num_attention_heads // tp
    core = sum(gemm_time(g, device, curve=curve) for g in gemms if g.name.startswith("attention_"))
    if not flash_attention:
        core += _attention_core_elementwise_bytes(heads, s, micro_batch_size) / bw
    measured = None if profile is None else lookup(
        profile, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups, ffn_hidden_size=model.ffn_hidden_size, swiglu=model.swiglu,
        seq_length=s, tp=tp, micro_batch_size=micro_batch_size)
    base = None if measured is not None or profile is None or tp == 1 else lookup(
        profile, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups, ffn_hidden_size=model.ffn_hidden_size, swiglu=model.swiglu,
        seq_length=s, tp=1, micro_batch_size=micro_batch_size)
    includes_comm = False
    if measured is not None:
        forward, backward = measured.forward_s, measured.backward_s
        source = f"profile:{profile.source or profile.device}"
        includes_comm = measured.includes_tp_comm
    elif base is not None:  # measured unsplit: scale to this TP size by the analytic model's ratio
        args = dict(micro_batch_size=micro_batch_size, seq_length=s, sequence_parallel=sequence_parallel,
                    flash_attention=flash_attention, curve=curve)
        split, whole = layer_times(model, device, tp=tp, **args), layer_times(model, device, tp=1, **args)
        forward = base.forward_s * split.forward_s / whole.forward_s
        backward = base.backward_s * split.backward_s / whole.backward_s
        source = f"profile:{profile.source or profile.device} (tp=1, scaled to tp={tp} analytically)"
    else:
        elementwise = layer_elementwise_bytes(model, micro_batch_size=micro_batch_size, seq_length=s, tp=tp,
                                              sequence_parallel=sequence_parallel,
                                              flash_attention=flash_attention) / bw
        forward = sum(gemm_time(g, device, curve=curve) for g in gemms) + elementwise
        backward = BACKWARD_TO_FORWARD * forward
        source = "analytic"
    extra = {"none": 0.0, "full": forward, "selective": core}[recompute]
    return LayerTimes(forward_s=forward, backward_s=backward + extra, source=source, includes_tp_comm=includes_comm)


def _measured_part(part: str, analytic, model: ModelSpec, *, micro_batch_size: int, seq_length: int | None,
                   tp: int, profile: Profile | None) -> LayerTimes:
    """A part's measured times (scaled from tp=1 by the analytic ratio when only that was measured),
    or the analytic ones."""
    here = analytic(tp)
    if profile is None:
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
                 tp: int = 1, curve: EfficiencyCurve | None = None, profile: Profile | None = None) -> LayerTimes:
    """Output layer GEMM plus the fp32 cross entropy over the rank's vocabulary shard
    (about three passes over ``4*s*b*V/t`` bytes: upcast, softmax, gradient); measured "output"
    part of ``profile`` (final norm, logits, cross entropy) when it has one for this shape."""
    def analytic(t: int) -> LayerTimes:
        gemm = logits_gemm(model, micro_batch_size=micro_batch_size, seq_length=seq_length, tp=t)
        cross_entropy = 3 * 4 * gemm.m * gemm.n / _bytes_per_s(device)
        forward = gemm_time(gemm, device, curve=curve) + cross_entropy
        return LayerTimes(forward_s=forward, backward_s=BACKWARD_TO_FORWARD * forward, source="analytic")

    return _measured_part("output", analytic, model, micro_batch_size=micro_batch_size, seq_length=seq_length,
                          tp=tp, profile=profile)


def embedding_times(model: ModelSpec, device: DeviceType, *, micro_batch_size: int,
                    seq_length: int | None = None, tp: int = 1, profile: Profile | None = None) -> LayerTimes:
    """Embedding gather (read + write ``2*s*b*h`` bytes) and its scatter-add backward; measured
    "embedding" part of ``profile`` when it has one for this shape."""
    s = model.seq_length if seq_length is None else seq_length

    def analytic(t: int) -> LayerTimes:  # the gathered activation is whole on every TP rank
        forward = 2 * 2 * s * micro_batch_size * model.hidden_size / _bytes_per_s(device)
        return LayerTimes(forward_s=forward, backward_s=BACKWARD_TO_FORWARD * forward, source="analytic")

    return _measured_part("embedding", analytic, model, micro_batch_size=micro_batch_size, seq_length=seq_length,
                          tp=tp, profile=profile)
