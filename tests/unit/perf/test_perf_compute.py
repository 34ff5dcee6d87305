"""Analytic compute times: efficiency curve, GEMM roofline, layer times, profile override."""

import pytest

from megatron_het.cluster import CATALOG, ConfigError, ModelSpec
from megatron_het.perf.compute import (
    DEFAULT_EFFICIENCY,
    ComputeParams,
    EfficiencyCurve,
    gemm_efficiency,
    gemm_time,
    layer_elementwise_bytes,
    layer_times,
    logits_times,
)
from megatron_het.perf.flops import Gemm
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


PARAMS = ComputeParams(gemm_efficiency=0.8, attention_efficiency=0.5, kernel_overhead_us=5.0)


def test_large_gemm_is_compute_bound():
    g = Gemm(name="fc1", m=4096, n=4096, k=4096)
    # 256x128 tiles: 16 x 32 = 512 tiles on 108 SMs -> 5 waves (540 slots), no padding; k = 4096 of k_half 64
    eff = 0.8 * (512 / 540) * 4096 / (4096 + 64)
    assert gemm_efficiency(g, A100, PARAMS) == pytest.approx(eff, rel=1e-12)
    expected = 5e-6 + 137_438_953_472 / (312e12 * eff)
    assert gemm_time(g, A100, params=PARAMS) == pytest.approx(expected, rel=1e-12)
    # the older smallest-dimension curve is still available: 2*4096^3 at 312e12 * 0.7*4096/4224
    curve = EfficiencyCurve(e_max=0.7, m_half=128)
    assert gemm_time(g, A100, curve=curve) == pytest.approx(6.4896e-4, rel=1e-4)


def test_wave_quantisation_and_padding():
    # 109 tiles of 256x128 on 108 SMs need two waves; smaller tiles fill them better, at a cost
    one_wave = Gemm(name="fc1", m=256 * 12, n=128 * 9, k=4096)  # 108 tiles: one full wave
    spill = Gemm(name="fc1", m=256 * 12 + 1, n=128 * 9, k=4096)  # a 13th tile row: 117 tiles
    full, partial = gemm_efficiency(one_wave, A100, PARAMS), gemm_efficiency(spill, A100, PARAMS)
    assert full == pytest.approx(0.8 * 4096 / 4160, rel=1e-12)
    assert partial < 0.9 * full
    # per FLOP, the spilled GEMM is slower
    per_flop = [gemm_time(g, A100, params=PARAMS) / g.flops for g in (one_wave, spill)]
    assert per_flop[1] > per_flop[0]
    # a short reduction depth (the attention core, k = head dim) runs below a deep one
    shallow = Gemm(name="attention_scores", m=2048, n=2048, k=64, batch=32)
    deep = Gemm(name="fc1", m=2048, n=2048, k=4096, batch=32)
    assert gemm_efficiency(shallow, A100, PARAMS) < 0.55 * gemm_efficiency(deep, A100, PARAMS)


def test_small_gemm_pays_the_kernel_cost_and_idle_sms():
    g = Gemm(name="attention_scores", m=64, n=64, k=64, batch=32)
    # 32 tiles of 64x64 fill 32 of 108 SMs at the small tile's 0.6, k=64 halves it again: compute
    # 2*64^3*32 FLOPs at 312e12 * 0.8*0.6*(32/108)*0.5 beats the memory time (786432 bytes at 2039 GB/s)
    compute = 16_777_216 / (312e12 * 0.8 * 0.6 * (32 / 108) * 0.5)
    assert compute > 786_432 / 2039e9
    assert gemm_time(g, A100, params=PARAMS) == pytest.approx(5e-6 + compute, rel=1e-12)
    tiny = Gemm(name="fc1", m=16, n=64, k=64)
    assert 5e-6 < gemm_time(tiny, A100, params=PARAMS) < 6e-6  # mostly fixed cost


def test_layer_times_add_up_by_part_and_recompute_orders():
    t = layer_times(GPT, A100, micro_batch_size=2, params=PARAMS, flash_attention=True)
    assert t.source == "analytic"
    assert sum(t.parts.values()) == pytest.approx(t.forward_s + t.backward_s, rel=1e-9)
    assert {"gemm:qkv", "gemm:fc1", "gemm:fc2", "gemm:projection", "attention", "elementwise",
            "kernel_overhead"} <= set(t.parts)
    # backward runs two GEMMs per forward GEMM: about twice the forward
    assert 1.8 * t.forward_s < t.backward_s < 2.6 * t.forward_s
    full = layer_times(GPT, A100, micro_batch_size=2, params=PARAMS, flash_attention=True, recompute="full")
    assert full.backward_s == pytest.approx(t.backward_s + t.forward_s)
    selective = layer_times(GPT, A100, micro_batch_size=2, params=PARAMS, flash_attention=True,
                            recompute="selective")
    assert t.backward_s < selective.backward_s < full.backward_s
    unfused = layer_times(GPT, A100, micro_batch_size=2, params=PARAMS, flash_attention=False)
    assert unfused.forward_s > t.forward_s  # the s x s softmax traffic


def test_kernel_costs_dominate_small_layers():
    tiny = ModelSpec(num_layers=2, hidden_size=128, num_attention_heads=2, seq_length=128, vocab_size=1000)
    t = layer_times(tiny, A100, micro_batch_size=1, params=PARAMS, flash_attention=True)
    assert t.parts["kernel_overhead"] > 0.5 * (t.forward_s + t.backward_s)
    big = layer_times(GPT, A100, micro_batch_size=8, params=PARAMS, flash_attention=True)
    assert big.parts["kernel_overhead"] < 0.05 * (big.forward_s + big.backward_s)


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


H100 = CATALOG["H100-SXM"]
FP8 = ComputeParams(gemm_efficiency=0.5, attention_efficiency=0.4, kernel_overhead_us=5.0)


def test_fp8_attention_is_priced_from_the_runs_own_figures():
    # the fused kernel stays 16-bit in fp8 runs: its time is the causal score FLOPs at
    # attention_efficiency of the 16-bit rate, from the fp8 class's figures (a profile's, a fit's)
    b, s, heads, d = 2, 2048, GPT.num_attention_heads, GPT.kv_channels

    def attention(eff):
        p = ComputeParams(gemm_efficiency=0.5, attention_efficiency=eff, kernel_overhead_us=5.0)
        return layer_times(GPT, H100, micro_batch_size=b, precision="fp8", params=p).parts["attention"]

    flops = 4 * b * heads * s * s * d * 0.5
    forward = flops / (H100.rate_tflops("bf16") * 1e12 * 0.4)
    assert attention(0.4) == pytest.approx(forward * 3.5, rel=1e-9)  # backward 2.5x the forward
    assert attention(0.2) == pytest.approx(2 * attention(0.4), rel=1e-9)


def test_fused_norm_casts_leave_only_the_transpose_of_qkv_and_fc1_inputs():
    b, s, h = 2, 2048, GPT.hidden_size
    bw = H100.memory_bandwidth_gbs * 1e9 * FP8.memory_efficiency
    fused = layer_times(GPT, H100, micro_batch_size=b, precision="fp8", params=FP8)
    separate = layer_times(GPT, H100, micro_batch_size=b, precision="fp8",
                           params=ComputeParams(**{**FP8.to_dict(), "fused_norm_casts": False}))
    # QKV and fc1 both take the [s*b, h] norm output: a separate cast_transpose reads 2 bytes and
    # writes 2 (fp8 and its transpose), the fused norm leaves only the transpose (read 1, write 1)
    expected = 2 * ((4 - 2) * s * b * h / bw)
    assert separate.forward_s - fused.forward_s == pytest.approx(expected, rel=1e-9)
    assert separate.backward_s == pytest.approx(fused.backward_s, rel=1e-12)  # gradient casts unchanged
    bf16 = ComputeParams(**{**FP8.to_dict(), "fused_norm_casts": False})
    assert layer_times(GPT, H100, micro_batch_size=b, params=bf16).forward_s == pytest.approx(
        layer_times(GPT, H100, micro_batch_size=b, params=FP8).forward_s, rel=1e-12)  # no casts in bf16


def test_an_moe_layer_is_priced_by_its_own_measurement_never_a_dense_one():
    """An MoE model of the same hidden/FFN sizes as a measured dense layer: the dense time would
    price it at a fraction of its routed compute (tools/profile_host.py --num-experts measures it)."""
    import dataclasses

    moe = dataclasses.replace(GPT, num_experts=8, moe_router_topk=2)
    dense = ProfileEntry(hidden_size=1024, num_attention_heads=16, num_query_groups=16, ffn_hidden_size=4096,
                         swiglu=False, seq_length=2048, micro_batch_size=1, tp=1, forward_s=0.5, backward_s=1.25,
                         peak_memory_bytes=10**9)
    measured = dataclasses.replace(dense, forward_s=0.9, backward_s=2.0, num_experts=8, moe_router_topk=2,
                                   moe_ffn_hidden_size=4096, moe_token_dispatcher_type="allgather")
    only_dense = Profile(device="CPU", entries=(dense,), method="test", source="p.json")
    assert layer_times(moe, CATALOG["CPU"], micro_batch_size=1, profile=only_dense).source == "analytic"
    both = Profile(device="CPU", entries=(dense, measured), method="test", source="p.json")
    t = layer_times(moe, CATALOG["CPU"], micro_batch_size=1, profile=both)
    assert (t.forward_s, t.backward_s, t.source) == (0.9, 2.0, "profile:p.json")
    assert layer_times(GPT, CATALOG["CPU"], micro_batch_size=1, profile=both).forward_s == 0.5


def test_an_expert_parallel_measurement_carries_its_all_to_all():
    """A layer measured over its EP ranks holds the all-to-all over the links it was measured on (a
    node's): stage_cost adds only what a slower link costs beyond them. An EP 1 measurement stands for
    the compute at any EP (each rank runs as many routed copies) and the whole all-to-all is added.
    Expert-TP > 1 never takes an EP entry (measured at expert-TP 1)."""
    import dataclasses

    from megatron_het.cluster import cluster_from_dict
    from megatron_het.perf.comm import Channel, island_channel, moe_dispatch_times
    from megatron_het.perf.predict import stage_cost

    moe = dataclasses.replace(GPT, num_experts=8, moe_router_topk=2, moe_token_dispatcher_type="alltoall")
    ep1 = ProfileEntry(hidden_size=1024, num_attention_heads=16, num_query_groups=16, ffn_hidden_size=4096,
                       swiglu=False, seq_length=2048, micro_batch_size=1, tp=1, forward_s=0.9, backward_s=2.0,
                       peak_memory_bytes=10**9, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=4096,
                       moe_token_dispatcher_type="alltoall")
    ep2 = dataclasses.replace(ep1, forward_s=1.2, backward_s=2.5, ep=2)
    island = cluster_from_dict({"islands": [{"name": "c", "device": "CPU", "nodes": 1, "gpus_per_node": 2}]}).island("c")
    node, slow = island_channel(island, same_node=True), Channel(bandwidth_gbps=1.0, latency_us=100.0, host_staged=False)
    only_ep1 = Profile(device="CPU", entries=(ep1,), method="test", source="p.json")
    both = Profile(device="CPU", entries=(ep1, ep2), method="test", source="p.json")
    assert layer_times(moe, CATALOG["CPU"], micro_batch_size=1, profile=both, ep=2).moe_grid == (2, 1)
    assert layer_times(moe, CATALOG["CPU"], micro_batch_size=1, profile=only_ep1, ep=2).moe_grid is None

    def a2a(link):
        return moe_dispatch_times(moe, micro_batch_size=1, tp=1, ep=2, etp=1, tp_link=link, grid_link=link,
                                  element_bytes=4)

    kw = dict(tp=1, micro_batch_size=1, precision="fp32", ep=2)
    on_node = stage_cost(moe, island, profile=both, ep_channel=node, **kw)
    assert (on_node.layer_forward_s, on_node.layer_backward_s) == (1.2, 2.5)
    farther = stage_cost(moe, island, profile=both, ep_channel=slow, **kw)
    assert farther.layer_forward_s == pytest.approx(1.2 + a2a(slow).forward_s - a2a(node).forward_s)
    assert farther.layer_forward_s > 1.2
    modelled = stage_cost(moe, island, profile=only_ep1, ep_channel=slow, **kw)
    assert modelled.layer_forward_s == pytest.approx(0.9 + a2a(slow).forward_s)
    assert stage_cost(moe, island, profile=both, ep_channel=slow, **kw, etp=2).layer_forward_s > 0.9  # EP 1 entry
