"""The neutral form every adapter reads into and writes from: full tensors under global names.

Names are megatron-het's full-state names (``megatron_het/checkpoint/full_state.py``):
``embedding.word_embeddings.weight``, ``decoder.layers.<i>.<...>``, ``decoder.final_layernorm.*``,
``output_layer.weight`` (untied only). Embedding and output rows are the *unpadded* vocabulary:
padding depends on the target (plan TP sizes, Megatron's TP), so each writer pads for itself.
The fused tensors keep megatron-core's TP=1 layout: ``linear_qkv`` interleaved per query group
([q_g, k_g, v_g] for each group g), swiglu ``linear_fc1`` as [gate; up].
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from megatron_het.checkpoint.convert.errors import ConvertError
from megatron_het.cluster import ModelSpec

WORD_EMBEDDING = "embedding.word_embeddings.weight"
POSITION_EMBEDDING = "embedding.position_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
VOCAB_ROWS = (WORD_EMBEDDING, OUTPUT_LAYER)  # tensors whose dim 0 is the (padded) vocabulary


@dataclass(frozen=True, kw_only=True)
class ModelState:
    """A model's weights in the neutral form, plus what readers learned about the run."""

    model: ModelSpec  # the model's shape
    tensors: Mapping[str, torch.Tensor] = field(repr=False)  # global name -> full tensor, unpadded vocab rows
    iteration: int = 0  # training iteration the weights come from (0 when unknown, e.g. from HF)
    tokenizer_model: str | None = None  # the run's SentencePiece model file, when the input names one


def layer_shapes(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Per-layer tensor suffix -> shape, for megatron-core's local spec of this model."""
    h, d, ffn = model.hidden_size, model.kv_channels, model.ffn_hidden_size
    qkv = (model.num_attention_heads + 2 * model.num_query_groups) * d
    fc1 = 2 * ffn if model.swiglu else ffn
    shapes = {
        "input_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": (qkv, h),
        "self_attention.linear_proj.weight": (h, model.num_attention_heads * d),
        "pre_mlp_layernorm.weight": (h,),
        "mlp.linear_fc1.weight": (fc1, h),
        "mlp.linear_fc2.weight": (h, ffn),
    }
    if model.normalization == "LayerNorm":  # RMSNorm has no bias
        shapes.update({"input_layernorm.bias": (h,), "pre_mlp_layernorm.bias": (h,)})
    if model.add_bias_linear:
        shapes.update({"self_attention.linear_proj.bias": (h,), "mlp.linear_fc1.bias": (fc1,),
                       "mlp.linear_fc2.bias": (h,)})
    if model.add_bias_linear or model.add_qkv_bias:
        shapes["self_attention.linear_qkv.bias"] = (qkv,)
    if model.qk_layernorm:
        for norm in ("q_layernorm", "k_layernorm"):
            shapes[f"self_attention.{norm}.weight"] = (d,)
            if model.normalization == "LayerNorm":
                shapes[f"self_attention.{norm}.bias"] = (d,)
    return shapes


def expected_shapes(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the neutral form and its shape (unpadded vocabulary)."""
    h = model.hidden_size
    out: dict[str, tuple[int, ...]] = {WORD_EMBEDDING: (model.vocab_size, h)}
    if model.position_embedding_type == "learned_absolute":  # rotary and none have no parameters
        out[POSITION_EMBEDDING] = (model.max_position_embeddings, h)
    for i in range(model.num_layers):
        for suffix, shape in layer_shapes(model).items():
            out[f"decoder.layers.{i}.{suffix}"] = shape
    out["decoder.final_layernorm.weight"] = (h,)
    if model.normalization == "LayerNorm":
        out["decoder.final_layernorm.bias"] = (h,)
    if model.untie_embeddings_and_output_weights:
        out[OUTPUT_LAYER] = (model.vocab_size, h)
    return out


def check_state(state: ModelState, *, source: str) -> None:
    """Every expected tensor present with its shape, nothing unexpected; errors name the tensor."""
    want = expected_shapes(state.model)
    missing = [n for n in want if n not in state.tensors]
    if missing:
        raise ConvertError(f"{source}: missing tensor {missing[0]!r} (and {len(missing) - 1} more) for a "
                           f"{state.model.num_layers}-layer model. Fix: check that the checkpoint is complete and "
                           f"that --model / its config describes it (num_layers, swiglu, untie_embeddings...)")
    for name, shape in want.items():
        got = tuple(state.tensors[name].shape)
        if got != shape:
            raise ConvertError(f"{source}: tensor {name!r} has shape {got}, the model needs {shape}. "
                               f"Fix: use the model description the checkpoint was trained with")
    extra = sorted(set(state.tensors) - set(want))
    if extra:
        raise ConvertError(f"{source}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all). "
                           f"Fix: the model description does not match the checkpoint (e.g. tied vs untied "
                           f"output layer, swiglu), pass the right --model")


def pad_vocab(tensor: torch.Tensor, rows: int, *, name: str) -> torch.Tensor:
    """Zero rows appended up to ``rows`` (Megatron pads the vocabulary for tensor parallelism)."""
    if tensor.shape[0] > rows:
        raise ConvertError(f"{name}: {tensor.shape[0]} vocabulary rows do not fit a padded vocabulary of {rows}. "
                           f"Fix: pad to at least {tensor.shape[0]} rows")
    pad = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, pad], dim=0)


def unpad_vocab(tensor: torch.Tensor, vocab_size: int, *, name: str) -> torch.Tensor:
    """The first ``vocab_size`` rows (drops Megatron's padding)."""
    if tensor.shape[0] < vocab_size:
        raise ConvertError(f"{name}: has {tensor.shape[0]} vocabulary rows, fewer than vocab_size {vocab_size}. "
                           f"Fix: pass the model's real (unpadded) vocab_size")
    return tensor[:vocab_size].clone()
