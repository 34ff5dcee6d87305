"""Megatron-LM adapter: a checkpoint's ``args`` that megatron-het's runtime does not build are refused by
name (field, value, fix), not converted into a model with other outputs; the args it writes say what
it builds."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_het.checkpoint.convert import ConvertError, megatron_args, model_from_megatron_args
from megatron_het.checkpoint.convert.megatron import FIXED_ARGS
from megatron_het.cluster import ModelSpec

GPT = ModelSpec(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8, vocab_size=50)
LLAMA = ModelSpec(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
                  seq_length=8, vocab_size=50, swiglu=True, untie_embeddings_and_output_weights=True)


def _args(model: ModelSpec, **changes) -> argparse.Namespace:
    args = megatron_args(model, tp=1, pp=1, padded_vocab=128, iteration=1)
    for key, value in changes.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
def test_written_args_read_back_as_the_model(model):
    assert model_from_megatron_args(_args(model), source="ckpt") == model


def test_args_of_an_older_megatron_without_the_fields_are_read():
    """Megatron-LM versions before a flag existed record no attribute for it: its default is meant."""
    args = _args(LLAMA)
    for arg in FIXED_ARGS:
        delattr(args, arg.name)
    assert model_from_megatron_args(args, source="ckpt") == LLAMA


# Model settings Megatron-LM records that the runtime does not build (zero-centred LayerNorm, ...).
@pytest.mark.parametrize(("field", "value", "fix"), [
    ("rotary_seq_len_interpolation_factor", 4, "without --rotary-seq-len-interpolation-factor"),
    ("use_rope_scaling", True, "without --use-rope-scaling"),
    ("num_experts", 8, "without --num-experts"),
    ("multi_latent_attention", True, "without --multi-latent-attention"),
    ("window_size", (128, 0), "without --window-size"),
    ("softmax_type", "learnable", "with --softmax-type vanilla"),
    ("apply_residual_connection_post_layernorm", True, "without --apply-residual-connection-post-layernorm"),
])
def test_llama_args_the_runtime_does_not_build_are_refused_by_name(field, value, fix):
    with pytest.raises(ConvertError) as e:
        model_from_megatron_args(_args(LLAMA, **{field: value}), source="ckpt/iter_0000001")
    message = str(e.value)
    assert message.startswith(f"ckpt/iter_0000001: args.{field}: not implemented: "), message
    assert f"megatron-het's runtime builds {field}=" in message, message
    assert f"(got {value!r}). Fix: convert a checkpoint trained {fix}" in message, message


@pytest.mark.parametrize(("arg", "value", "field"), [
    ("normalization", "LayerNorm", "normalization"),
    ("position_embedding_type", "learned_absolute", "position_embedding_type"),
    ("position_embedding_type", "none", "position_embedding_type"),
    ("add_bias_linear", True, "add_bias_linear"),
    ("add_qkv_bias", True, "add_qkv_bias"),
    ("qk_layernorm", True, "qk_layernorm"),
    ("apply_layernorm_1p", True, "layernorm_zero_centered_gamma"),
    ("rotary_interleaved", True, "rotary_interleaved"),
])
def test_architecture_args_are_read_into_the_model(arg, value, field):
    """#35 item 3: each architecture choice Megatron-LM records is the model's own field, not a recipe
    the checkpoint must match; written back, it says the same."""
    changes = {arg: value}
    if arg == "position_embedding_type":  # Megatron-LM records both
        changes["add_position_embedding"] = value == "learned_absolute"
    model = model_from_megatron_args(_args(LLAMA, **changes), source="ckpt")
    assert getattr(model, field) == value
    assert model_from_megatron_args(megatron_args(model, tp=1, pp=1, padded_vocab=128, iteration=1),
                                    source="ckpt") == model


def test_squared_relu_is_read_and_an_unknown_norm_refused():
    assert model_from_megatron_args(_args(GPT, squared_relu=True), source="ckpt").squared_relu
    with pytest.raises(ConvertError, match=r"args.normalization: not implemented: megatron-het builds normalization "
                                           r"LayerNorm or RMSNorm only \(got 'L2Norm'\)"):
        model_from_megatron_args(_args(LLAMA, normalization="L2Norm"), source="ckpt")
    with pytest.raises(ConvertError, match=r"args.position_embedding_type: .*\(got 'yarn'\)"):
        model_from_megatron_args(_args(LLAMA, position_embedding_type="yarn"), source="ckpt")


@pytest.mark.parametrize(("field", "value"), [
    ("rotary_base", 500000), ("rotary_base", 1000000), ("rotary_percent", 0.5), ("layernorm_epsilon", 1e-6),
    ("kv_channels", 8), ("init_method_std", 0.006)])
def test_llama_3_arguments_are_read_into_the_model(field, value):
    """A Llama-3 checkpoint's rotary base, a partial rotary, another epsilon, wider heads, another init std:
    the model the runtime builds (#35 item 3), not a refusal."""
    assert getattr(model_from_megatron_args(_args(LLAMA, **{field: value}), source="ckpt"), field) == value
    assert model_from_megatron_args(_args(LLAMA, kv_channels=None), source="ckpt") == LLAMA


def test_older_megatron_spelling_of_the_epsilon_is_read():
    args = _args(LLAMA)
    del args.layernorm_epsilon
    args.norm_epsilon = 1e-6
    assert model_from_megatron_args(args, source="ckpt").layernorm_epsilon == 1e-6


def test_written_args_record_what_the_runtime_builds():
    args = _args(dataclasses.replace(LLAMA, rotary_base=500000, layernorm_epsilon=1e-6))
    assert (args.rotary_base, args.apply_layernorm_1p, args.layernorm_epsilon, args.rotary_percent) == (
        500000, False, 1e-6, 1.0)
