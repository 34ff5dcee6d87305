"""Stage memory against the Megatron docs' bytes/param table and Korthikanti et al. 2022."""

import pytest

from megatron_het.cluster import CATALOG, ConfigError, ModelSpec
from megatron_het.perf.flops import stage_parameters
from megatron_het.perf.memory import (
    DEFAULT_OVERHEAD_BYTES,
    activation_bytes_per_layer,
    device_capacity_bytes,
    microbatches_in_flight,
    stage_memory,
)

GPT = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=2048, vocab_size=50304)
LLAMA2_7B = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                      seq_length=4096, vocab_size=32000, swiglu=True, untie_embeddings_and_output_weights=True)


def _model_state_bytes_per_param(dp: int, distributed: bool) -> float:
    mem = stage_memory(GPT, num_layers=4, is_first=True, is_last=True, micro_batch_size=1, microbatches_in_flight=1,
                       dp=dp, distributed_optimizer=distributed)
    params = stage_parameters(GPT, num_layers=4, is_first=True, is_last=True)
    return (mem.parameters_bytes + mem.gradients_bytes + mem.optimizer_bytes) / params


def test_bytes_per_param_match_megatron_distrib_optimizer_table():
    # Megatron Core "Distributed Optimizer" docs: bf16 param + fp32 grads: 18 vs 6 + 12/d.
    assert _model_state_bytes_per_param(8, distributed=False) == 18
    assert _model_state_bytes_per_param(1, distributed=True) == 18
    assert _model_state_bytes_per_param(4, distributed=True) == 6 + 12 / 4
    assert _model_state_bytes_per_param(8, distributed=True) == 6 + 12 / 8


@pytest.mark.parametrize("tp,sp,recompute,paper", [
    (1, False, "none", lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h)),
    (4, False, "none", lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
    (4, True, "none", lambda s, b, h, a, t: s * b * h / t * (34 + 5 * a * s / h)),
    (4, False, "selective", lambda s, b, h, a, t: s * b * h * (10 + 24 / t)),
    (4, True, "selective", lambda s, b, h, a, t: 34 * s * b * h / t),
    (1, False, "full", lambda s, b, h, a, t: 2 * s * b * h),
    (4, True, "full", lambda s, b, h, a, t: 2 * s * b * h / t),
])
def test_activations_per_layer_match_korthikanti(tp, sp, recompute, paper):
    got = activation_bytes_per_layer(GPT, micro_batch_size=2, tp=tp, sequence_parallel=sp, recompute=recompute)
    assert got == paper(2048, 2, 1024, 16, tp)


def test_activations_without_tp_concrete_value():
    # s*b*h*(34 + 5as/h) = 2048*2*1024*(34 + 5*16*2048/1024) = 4194304 * 194
    assert activation_bytes_per_layer(GPT, micro_batch_size=2) == 813_694_976


def test_flash_attention_drops_the_s_squared_term():
    # 34sbh + 4*a*s*b = 34*4194304 + 4*16*2048*2
    assert activation_bytes_per_layer(GPT, micro_batch_size=2, flash_attention=True) == 142_606_336 + 262_144


def test_microbatches_in_flight_1f1b_and_interleaved():
    assert [microbatches_in_flight(stage=i, pipeline_size=4, num_microbatches=8) for i in range(4)] == [4, 3, 2, 1]
    assert microbatches_in_flight(stage=0, pipeline_size=4, num_microbatches=2) == 2
    # interleaved, v=2: warm-up 2*(4-0-1) + (2-1)*4 = 10, +1 in steady state = 11 chunk micro-batches,
    # i.e. 11/2 = 5.5 = 4 * (1 + (p-1)/(p*v)) stage-equivalents
    assert microbatches_in_flight(stage=0, pipeline_size=4, num_microbatches=8, virtual_stages=2) == 11
    assert microbatches_in_flight(stage=3, pipeline_size=4, num_microbatches=8, virtual_stages=2) == 5
    assert microbatches_in_flight(stage=0, pipeline_size=4, num_microbatches=2, virtual_stages=2) == 4


def test_llama2_7b_first_stage_of_four_by_hand():
    mem = stage_memory(LLAMA2_7B, num_layers=8, is_first=True, is_last=False, micro_batch_size=1,
                       microbatches_in_flight=4, dp=2, recompute="full")
    # params: 8 layers * 202383360 + word embeddings 32000*4096 = 1619066880 + 131072000 = 1750138880
    p = 1_750_138_880
    assert mem.parameters_bytes == 2 * p == 3_500_277_760
    assert mem.gradients_bytes == 4 * p == 7_000_555_520
    assert mem.optimizer_bytes == 12 * p // 2 == 10_500_833_280
    # activations: full recompute keeps 2sbh = 33554432 per layer: x 8 layers x 4 micro-batches = 1073741824;
    # embedding dropout mask sbh = 16777216 x 4 = 67108864; plus one layer recomputed in full, less its
    # stored input: 10sbh (167772160) + s*b*(2h + 4h + 2h) (134217728) + s*b*(4f + 2f) (270532608)
    # + 5as^2b (2684354560) - 33554432 = 3223322624
    assert mem.activations_bytes == 1_073_741_824 + 67_108_864 + 3_223_322_624
    assert mem.overhead_bytes == DEFAULT_OVERHEAD_BYTES == 1_610_612_736
    assert mem.total_bytes == 3_500_277_760 + 7_000_555_520 + 10_500_833_280 + 4_364_173_312 + 1_610_612_736
    assert mem.largest_part() == "optimizer"
    assert mem.fits(device_capacity_bytes(CATALOG["A100-40GB"]))
    assert not mem.fits(device_capacity_bytes(CATALOG["RTX-4090"]))


def test_last_stage_counts_logits_and_output_layer():
    common = dict(num_layers=8, micro_batch_size=1, microbatches_in_flight=1, is_first=False)
    middle = stage_memory(LLAMA2_7B, is_last=False, **common)
    last = stage_memory(LLAMA2_7B, is_last=True, **common)
    assert last.parameters_bytes - middle.parameters_bytes == 2 * (32000 * 4096 + 4096)
    # final norm input + output-layer input 4sbh = 67108864; fp32 logits 4*s*b*V = 524288000
    assert last.activations_bytes - middle.activations_bytes == 67_108_864 + 524_288_000


def test_validation_messages():
    with pytest.raises(ConfigError, match=r"virtual_stages: num_layers=8 does not split .* \(got 3\)"):
        stage_memory(LLAMA2_7B, num_layers=8, is_first=True, is_last=False, micro_batch_size=1,
                     microbatches_in_flight=1, virtual_stages=3)
    with pytest.raises(ConfigError, match=r"stage: must be < pipeline_size \(4\) \(got 4\)"):
        microbatches_in_flight(stage=4, pipeline_size=4, num_microbatches=8)
    with pytest.raises(ConfigError, match="seq_length: sequence parallelism needs .*tp=3"):
        activation_bytes_per_layer(ModelSpec(num_layers=1, hidden_size=48, num_attention_heads=3, seq_length=100,
                                             vocab_size=10), micro_batch_size=1, tp=3, sequence_parallel=True)
