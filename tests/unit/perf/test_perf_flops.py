"""FLOPs and parameter counts against hand-computed values."""

from fractions import Fraction

import pytest

from megatron_het.cluster import ConfigError, ModelSpec
from megatron_het.perf.flops import (
    layer_forward_flops,
    layer_gemms,
    layer_parameters,
    layer_parameters_per_rank,
    layer_training_flops,
    logits_forward_flops,
    model_flops_per_iteration,
    padded_vocab_size,
    stage_parameters,
    total_parameters,
)

GPT3 = ModelSpec(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048, vocab_size=50257)
LLAMA2_7B = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                      seq_length=4096, vocab_size=32000, swiglu=True, untie_embeddings_and_output_weights=True)
TINY = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000)


def test_tiny_gpt_layer_forward_flops_by_hand():
    # 24*b*s*h^2 + 4*b*s^2*h with b=3, s=32, h=64: 24*3*32*4096 + 4*3*1024*64 = 9437184 + 786432
    assert layer_forward_flops(TINY, micro_batch_size=3) == 10_223_616
    # logits: 2*b*s*h*V = 2*3*32*64*1000
    assert logits_forward_flops(TINY, micro_batch_size=3) == 12_288_000


@pytest.mark.parametrize("model", [TINY, GPT3], ids=["tiny", "gpt3"])
def test_model_flops_reduce_to_narayanan_formula(model):
    b, s, l, h, v = 8, model.seq_length, model.num_layers, model.hidden_size, model.vocab_size
    no_recompute = 72 * b * s * l * h**2 * (1 + Fraction(s, 6 * h) + Fraction(v, 12 * l * h))
    with_recompute = 96 * b * s * l * h**2 * (1 + Fraction(s, 6 * h) + Fraction(v, 16 * l * h))  # eq. (3)
    assert model_flops_per_iteration(model, global_batch_size=b) == no_recompute
    assert model_flops_per_iteration(model, global_batch_size=b, recompute="full") == with_recompute


def test_gpt3_iteration_flops_magnitude():
    # 1536 sequences: 72*1536*2048*96*12288^2 = 3.2831e18, times (1 + 2048/73728 + 50257/14155776)
    # = 1.031328 -> 3.3860e18 (the ~6 * params * tokens rule gives 3.30e18 without attention)
    assert model_flops_per_iteration(GPT3, global_batch_size=1536) == pytest.approx(3.3860e18, rel=1e-4)


def test_gqa_and_swiglu_gemm_shapes():
    model = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                      ffn_hidden_size=96, seq_length=16, vocab_size=100, swiglu=True)
    gemms = {g.name: g for g in layer_gemms(model, micro_batch_size=2)}
    assert (gemms["qkv"].m, gemms["qkv"].n, gemms["qkv"].k) == (32, (8 + 2 * 2) * 8, 64)
    assert gemms["fc1"].n == 192  # gate and up halves
    assert (gemms["attention_scores"].batch, gemms["attention_scores"].m, gemms["attention_scores"].k) == (16, 16, 8)
    # 2*32*96*64 + 2*2*8*16*16*8 * 2 + 2*32*64*64 + 2*32*192*64 + 2*32*64*96
    assert layer_forward_flops(model, micro_batch_size=2) == 393216 + 131072 + 262144 + 786432 + 393216


def test_tensor_parallel_splits_flops_evenly():
    assert layer_forward_flops(GPT3, micro_batch_size=1, tp=8) * 8 == layer_forward_flops(GPT3, micro_batch_size=1)


def test_recompute_adds_forward_or_attention_core():
    fwd = layer_forward_flops(TINY, micro_batch_size=3)
    assert layer_training_flops(TINY, micro_batch_size=3) == 3 * fwd
    assert layer_training_flops(TINY, micro_batch_size=3, recompute="full") == 4 * fwd
    # selective redoes QK^T and attention-over-V: 4*b*s^2*h = 786432
    assert layer_training_flops(TINY, micro_batch_size=3, recompute="selective") == 3 * fwd + 786_432


def test_bad_tp_and_recompute_name_field_value_and_fix():
    with pytest.raises(ConfigError, match=r"tp: num_attention_heads=4 is not divisible by tp=3 \(got 3\)"):
        layer_forward_flops(TINY, micro_batch_size=1, tp=3)
    with pytest.raises(ConfigError, match="recompute: unknown .*'partial'.*full"):
        layer_training_flops(TINY, micro_batch_size=1, recompute="partial")


def test_gpt3_175b_parameter_count():
    # layer: 12h^2 + 13h = 12*150994944 + 13*12288 = 1812099072; x96 = 173961510912
    # embeddings: 50257*12288 + 2048*12288 = 617558016 + 25165824; final LayerNorm 2h = 24576
    assert layer_parameters(GPT3) == 1_812_099_072
    assert total_parameters(GPT3) == 174_604_259_328


def test_llama2_7b_parameter_count():
    # layer: 4h^2 (q,k,v,o) + 3*h*f (gate, up, down) + 2h (RMSNorm) = 67108864 + 135266304 + 8192
    # x32 = 6476267520; embeddings + untied output 2*32000*4096 = 262144000; final norm 4096
    assert layer_parameters(LLAMA2_7B) == 202_383_360
    assert total_parameters(LLAMA2_7B) == 6_738_415_616


def test_stage_parameters_sum_to_total():
    stages = [(8, True, False), (8, False, False), (8, False, False), (8, False, True)]
    total = sum(stage_parameters(LLAMA2_7B, num_layers=n, is_first=f, is_last=l) for n, f, l in stages)
    assert total == total_parameters(LLAMA2_7B)
    # Tied GPT keeps a second copy of the word embeddings on the last stage.
    gpt = sum(stage_parameters(GPT3, num_layers=48, is_first=f, is_last=l) for f, l in ((True, False), (False, True)))
    assert gpt == total_parameters(GPT3) + 50257 * 12288


def test_per_rank_layer_parameters_under_tp():
    # TINY h=64, tp=2: weights 12h^2/2 = 24576; biases qkv 3h/2 + proj h + fc1 4h/2 + fc2 h = 96+64+128+64;
    # LayerNorms 4h = 256
    assert layer_parameters_per_rank(TINY, tp=2) == 24576 + 352 + 256


def test_padded_vocab_size():
    assert padded_vocab_size(50257) == 50304
    assert padded_vocab_size(50257, tp=8) == 51200
    assert padded_vocab_size(32000, tp=2) == 32000
