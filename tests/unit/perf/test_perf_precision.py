"""Precision (#17 item 1): rates per precision from the catalog, bytes per state and activation, and an
fp32 and a bf16 run of one configuration priced apart by exactly the datasheet ratios."""

import json
from dataclasses import replace

import pytest

from megatron_het.cluster import CATALOG, ConfigError, ModelSpec, cluster_from_dict
from megatron_het.perf import predict, stage_memory
from megatron_het.perf.compute import ComputeParams, gemm_time
from megatron_het.perf.flops import Gemm
from megatron_het.perf.memory import activation_bytes_per_layer, state_bytes
from megatron_het.plan import Plan, PlanError, homogeneous_plan

A100 = CATALOG["A100-80GB"]
H100 = CATALOG["H100-SXM"]
GPT = ModelSpec(num_layers=8, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=50304)


def test_catalog_rates_per_precision():
    assert (A100.rate_tflops("fp32"), A100.rate_tflops("tf32"), A100.rate_tflops("bf16")) == (19.5, 156.0, 312.0)
    assert A100.rate_tflops("fp8") == 312.0  # no fp8 on Ampere: Transformer Engine falls back to 16-bit GEMMs
    assert (H100.rate_tflops("fp32"), H100.rate_tflops("tf32"), H100.rate_tflops("fp8")) == (67.0, 494.7, 1978.9)
    assert CATALOG["MI250X"].rate_tflops("tf32") == 47.85  # FP32 matrix rate per GCD
    for device in CATALOG.values():
        assert device.rate_tflops("bf16") == device.peak_tflops
        assert device.rate_tflops("fp32") <= device.rate_tflops("tf32") <= device.rate_tflops("bf16") \
            <= device.rate_tflops("fp8")
    with pytest.raises(ConfigError, match="precision: unknown precision"):
        A100.rate_tflops("int4")
    # a cluster file overriding peak_tflops moves the 16-bit rates with it
    custom = replace(A100, peak_tflops=500.0)
    assert custom.rate_tflops("bf16") == custom.rate_tflops("fp16") == 500.0


def test_gemm_time_ratio_is_the_datasheet_rate_ratio():
    params = ComputeParams(gemm_efficiency=0.8, attention_efficiency=0.5, kernel_overhead_us=0.0)
    g = Gemm(name="fc1", m=8192, n=8192, k=8192)  # compute bound at every precision
    t = {p: gemm_time(g, H100, precision=p, params=params) for p in ("fp32", "tf32", "bf16", "fp8")}
    assert t["fp32"] / t["bf16"] == pytest.approx(989.4 / 67.0, rel=1e-12)
    assert t["tf32"] / t["bf16"] == pytest.approx(989.4 / 494.7, rel=1e-12)
    assert t["bf16"] / t["fp8"] == pytest.approx(1978.9 / 989.4, rel=1e-12)


def test_state_and_activation_bytes_follow_precision():
    # Megatron's distributed optimizer table: fp16 20 | 4 + 16/d, bf16 18 | 6 + 12/d, fp32 16 | 8 + 8/d
    assert {p: sum(state_bytes(p)) for p in ("fp16", "bf16", "fp32", "tf32", "fp8")} == \
        {"fp16": 20, "bf16": 18, "fp32": 16, "tf32": 16, "fp8": 18}
    for recompute in ("full", "selective"):
        args = dict(micro_batch_size=2, tp=2, recompute=recompute)
        fp32, bf16 = (activation_bytes_per_layer(GPT, precision=p, **args) for p in ("fp32", "bf16"))
        if recompute == "full":
            assert fp32 == 2 * bf16  # only the layer input, 4 bytes instead of 2
        else:  # dropout masks stay one byte: 2 per token and hidden unit outside the TP region
            assert fp32 - 2 * bf16 == -2 * 2048 * 2 * 2048
    with pytest.raises(ConfigError, match="precision"):
        state_bytes("fp64")


def _cluster():
    return cluster_from_dict({"islands": [{"name": "pod", "device": "A100-80GB", "nodes": 1, "gpus_per_node": 8}]})


def test_fp32_and_bf16_of_one_configuration_are_priced_apart():
    cluster = _cluster()
    plan = homogeneous_plan(tp=2, pp=2, dp=2, num_layers=GPT.num_layers, micro_batch_size=2, global_batch_size=32,
                            island="pod", device_type="A100-80GB")
    bf16 = predict(replace(plan, precision="bf16"), GPT, cluster)
    fp32 = predict(replace(plan, precision="fp32"), GPT, cluster)
    tf32 = predict(replace(plan, precision="tf32"), GPT, cluster)
    assert bf16.iteration_time_s < tf32.iteration_time_s < fp32.iteration_time_s
    # compute dominates this configuration: the fp32/bf16 ratio approaches the rate ratio (16), well above 4
    assert fp32.pipeline_time_s / bf16.pipeline_time_s > 4
    for i, (s32, s16) in enumerate(zip(fp32.replicas[0].stages, bf16.replicas[0].stages)):
        m32, m16 = s32.memory, s16.memory
        assert m32.parameters_bytes == 2 * m16.parameters_bytes  # 4 vs 2 bytes per weight
        assert m32.gradients_bytes == m16.gradients_bytes  # fp32 gradients in both
        assert m32.optimizer_bytes * 12 == pytest.approx(m16.optimizer_bytes * 8, abs=12)  # moments only vs +master
        # 4-byte activations; the last stage's fp32 logits are 4 bytes in both runs
        assert m32.activations_bytes > (1.85 if i == 0 else 1.5) * m16.activations_bytes
    direct = stage_memory(GPT, num_layers=4, is_first=True, is_last=False, micro_batch_size=2,
                          microbatches_in_flight=2, tp=2, precision="fp16")
    assert direct.gradients_bytes == direct.parameters_bytes  # fp16 gradients: 2 bytes like the weights


def test_plan_records_its_precision_and_old_files_load_as_bf16(tmp_path):
    plan = homogeneous_plan(tp=1, pp=1, dp=1, num_layers=2, micro_batch_size=1, global_batch_size=1)
    assert plan.precision == "bf16"
    data = replace(plan, precision="fp32").to_dict()
    assert data["precision"] == "fp32"
    assert Plan.from_dict(json.loads(json.dumps(data))).precision == "fp32"
    del data["precision"]  # a plan written before the field existed
    assert Plan.from_dict(data).precision == "bf16"
    with pytest.raises(PlanError, match="precision: unknown precision"):
        Plan.from_dict(dict(data, precision="fp64"), source="p.json")
