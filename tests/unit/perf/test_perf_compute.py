"""Analytic compute times: efficiency curve, GEMM roofline, layer times, profile override."""

import pytest

from megatron_het.cluster import CATALOG, ConfigError, ModelSpec
from megatron_het.perf.compute import (
    DEFAULT_EFFICIENCY,
    EfficiencyCurve,
    gemm_time,
    layer_elementwise_bytes,
    layer_times,
    logits_times,
)
from megatron_het.perf.flops import Gemm, layer_gemms
from megatron_het.perf.profile import Profile, ProfileEntry

A100 = CATALOG["A100-80GB"]
GPT = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=2048, vocab_size=50304)


def test_efficiency_curve_rises_and_saturates():
    curve = EfficiencyCurve(e_max=0.7, m_half=128)
    values = [curve.efficiency(m) for m in (1, 16, 64, 128, 512, 4096, 65536)]
    assert values == sorted(values) and len(set(values)) == len(values)
    assert curve.efficiency(128) == pytest.approx(0.35)
    assert values[-1] < 0.7
    for vendor in ("nvidia", "amd", "cpu"):
        assert 0 < DEFAULT_EFFICIENCY[vendor].e_max <= 1


def test_efficiency_curve_validation():
    with pytest.raises(ConfigError, match=r"e_max: must be in \(0, 1\] \(got 1.5\)"):
        EfficiencyCurve(e_max=1.5, m_half=128)


def test_large_gemm_is_compute_bound():
    g = Gemm(name="fc1", m=4096, n=4096, k=4096)
    # 2*4096^3 FLOPs at 312 TFLOP/s * 0.7*4096/(4096+128)
    expected = 137_438_953_472 / (312e12 * 0.7 * 4096 / 4224)
    assert gemm_time(g, A100) == pytest.approx(expected, rel=1e-12)
    assert gemm_time(g, A100) == pytest.approx(6.4896e-4, rel=1e-4)


def test_small_gemm_is_memory_bound():
    g = Gemm(name="attention_scores", m=64, n=64, k=64, batch=32)
    # compute: 2*64^3*32 = 16777216 FLOPs at 312e12 * 0.7*64/192 -> 2.30e-7 s
    # memory: 2*(3*4096)*32 = 786432 bytes at 2039 GB/s -> 3.86e-7 s, the larger
    assert gemm_time(g, A100) == pytest.approx(786_432 / 2039e9, rel=1e-12)


def test_layer_forward_is_gemms_plus_elementwise_and_backward_twice():
    t = layer_times(GPT, A100, micro_batch_size=2)
    gemms = sum(gemm_time(g, A100) for g in layer_gemms(GPT, micro_batch_size=2))
    elementwise = layer_elementwise_bytes(GPT, micro_batch_size=2) / 2039e9
    assert t.forward_s == pytest.approx(gemms + elementwise)
    assert t.backward_s == pytest.approx(2 * t.forward_s)
    assert t.source == "analytic"
    full = layer_times(GPT, A100, micro_batch_size=2, recompute="full")
    assert full.backward_s == pytest.approx(3 * t.forward_s)
    selective = layer_times(GPT, A100, micro_batch_size=2, recompute="selective")
    assert t.backward_s < selective.backward_s < full.backward_s


def test_elementwise_bytes_by_hand():
    # norms + residuals (8 + 14)*s*b*h = 22*2048*2*1024 = 92274688; gelu 4*s*b*f = 4*2048*2*4096 = 67108864;
    # softmax + dropout 9*a*s^2*b = 9*16*2048^2*2 = 1207959552
    assert layer_elementwise_bytes(GPT, micro_batch_size=2) == 92_274_688 + 67_108_864 + 1_207_959_552
    assert layer_elementwise_bytes(GPT, micro_batch_size=2, flash_attention=True) == 92_274_688 + 67_108_864


def test_faster_device_and_tensor_parallelism_shorten_layers():
    v100 = layer_times(GPT, CATALOG["V100-32GB"], micro_batch_size=2).forward_s
    a100 = layer_times(GPT, A100, micro_batch_size=2).forward_s
    a100_tp2 = layer_times(GPT, A100, micro_batch_size=2, tp=2).forward_s
    assert v100 > a100 > a100_tp2 > a100 / 2.5


def test_profile_overrides_analytic_time():
    entry = ProfileEntry(hidden_size=1024, num_attention_heads=16, num_query_groups=16, ffn_hidden_size=4096,
                         swiglu=False, seq_length=2048, micro_batch_size=1, tp=1, forward_s=0.5, backward_s=1.25,
                         peak_memory_bytes=10**9)
    profile = Profile(device="CPU", entries=(entry,), method="test", source="p.json")
    t = layer_times(GPT, CATALOG["CPU"], micro_batch_size=2, profile=profile)
    assert (t.forward_s, t.backward_s, t.source) == (1.0, 2.5, "profile:p.json")  # scaled by tokens
    full = layer_times(GPT, CATALOG["CPU"], micro_batch_size=2, profile=profile, recompute="full")
    assert full.backward_s == 3.5
    other = ModelSpec(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=2048, vocab_size=50304)
    assert layer_times(other, CATALOG["CPU"], micro_batch_size=2, profile=profile).source == "analytic"


def test_logits_time_positive_and_split_by_tp():
    one = logits_times(GPT, A100, micro_batch_size=2)
    two = logits_times(GPT, A100, micro_batch_size=2, tp=2)
    assert one.forward_s > two.forward_s > 0
