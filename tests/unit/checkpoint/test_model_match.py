"""--load compares the checkpoint's model with the run's: architecture must match (a checkpoint from
before a setting existed counts as its swiglu recipe's value), dropout and the init std need not."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_het.checkpoint.dist_ckpt import CheckpointError, check_model_matches, model_common_state
from megatron_het.cluster import ModelSpec

LLAMA = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=128, swiglu=True)


def test_dropout_and_init_std_may_differ_from_the_saved_run():
    common = {"model": model_common_state(LLAMA)}
    check_model_matches(common, dataclasses.replace(LLAMA, hidden_dropout=0.1, attention_dropout=0.1,
                                                    init_method_std=0.01), "ckpt")


def test_a_checkpoint_from_before_the_architecture_fields_is_its_recipe():
    """Written when --swiglu alone meant RMSNorm, rotary positions and no biases."""
    old = {k: v for k, v in model_common_state(LLAMA).items()
           if k not in ("normalization", "position_embedding_type", "add_bias_linear", "rotary_interleaved")}
    check_model_matches({"model": old}, LLAMA, "ckpt")
    megatron_defaults = dataclasses.replace(LLAMA, normalization="LayerNorm", position_embedding_type="learned_absolute",
                                            add_bias_linear=True)  # a flags-only run of today with --swiglu
    with pytest.raises(CheckpointError, match=r"model.normalization: the checkpoint was trained with "
                                              r"normalization='RMSNorm', this run has normalization='LayerNorm'"):
        check_model_matches({"model": old}, megatron_defaults, "ckpt")
