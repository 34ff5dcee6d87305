"""Megatron-LM dist checkpoints (``torch_dist``, any TP/PP) <-> the neutral form.

Megatron-LM saves ``{"model": GPTModel.sharded_state_dict(), "args": Namespace, "iteration", ...}``.
megatron-core keys every layer tensor once for all layers (stacked on a leading layer axis, global
layer index, so PP does not change the keys), names norms as transformer-engine's fused modules do
(``self_attention.linear_qkv.layer_norm_weight`` for the input norm) and stores swiglu ``linear_fc1``
as [gate; up] whatever the TP size. Only the vocabulary padding (a multiple of 128 * TP) depends on
TP. Writing therefore builds a real megatron-core GPTModel (local spec, TP=1) holding the weights and
saves its own ``sharded_state_dict`` (so the keys are exactly megatron-core's); reading maps the keys.
Optimizer state and RNG are not written: load with ``--finetune`` or ``--no-load-optim --no-load-rng``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatron_het.checkpoint.convert.errors import ConvertError
from megatron_het.checkpoint.convert.hf_tokenizer import TOKENIZER_MODEL
from megatron_het.checkpoint.convert.io import counted, single_process_group
from megatron_het.checkpoint.convert.state import (
    VOCAB_ROWS,
    ModelState,
    check_state,
    expected_shapes,
    layer_shapes,
    pad_vocab,
    unpad_vocab,
)
from megatron_het.cluster import ModelSpec
from megatron_het.cluster.model_spec import NORMALIZATIONS, POSITION_EMBEDDING_TYPES, recipe_of
from megatron_het.utils.atomic import write_bytes_atomic, write_text_atomic
from megatron_het.utils.progress import ProgressCallback

CHECKPOINT_VERSION = 3.0  # Megatron-LM's value for dist checkpoints
# megatron-core's local spec saves these norms under transformer-engine's fused-module names.
_TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


@dataclass(frozen=True)
class FixedArg:
    """A Megatron-LM argument that changes what a checkpoint's weights compute, at the value
    megatron-het's runtime builds (model/gpt.py: megatron-core's defaults but for the recipe's).
    ModelSpec has no field for it, so a checkpoint with another value is refused by name."""

    name: str  # Megatron-LM's args attribute
    value: object  # what megatron-het builds (and what megatron_args records)
    what: str  # what another value would mean, for the message
    trained: str  # how a checkpoint megatron-het can take was trained, for the fix
    rope: bool = False  # only matters for rotary position embeddings (the Llama recipe)


FIXED_ARGS = (
    FixedArg("rotary_seq_len_interpolation_factor", None, "rotary position interpolation",
             "without --rotary-seq-len-interpolation-factor", rope=True),
    FixedArg("use_rope_scaling", False, "Llama-3.1-style rotary scaling", "without --use-rope-scaling", rope=True),
    FixedArg("no_rope_freq", None, "layers without the rotary embedding", "without --no-rope-freq", rope=True),
    FixedArg("apply_residual_connection_post_layernorm", False, "the residual taken after the norm",
             "without --apply-residual-connection-post-layernorm"),
    FixedArg("openai_gelu", False, "the tanh GeLU", "without --openai-gelu"),
    FixedArg("quick_geglu", False, "the quick-GeGLU activation", "without --quick-geglu"),
    FixedArg("glu_linear_offset", 0.0, "an offset in the gated MLP", "without --glu-linear-offset"),
    FixedArg("activation_func_clamp_value", None, "a clamped activation", "without --activation-func-clamp-value"),
    FixedArg("qk_l2_norm", False, "query/key L2 norms", "without --qk-l2-norm"),
    FixedArg("multi_latent_attention", False, "multi-latent attention", "without --multi-latent-attention"),
    FixedArg("attention_output_gate", False, "a gated attention output", "without --attention-output-gate"),
    FixedArg("experimental_attention_variant", None, "another attention variant",
             "without --experimental-attention-variant"),
    FixedArg("softmax_type", "vanilla", "another attention softmax", "with --softmax-type vanilla"),
    FixedArg("window_size", None, "sliding-window attention", "without --window-size"),
    FixedArg("num_experts", None, "mixture-of-experts MLPs", "without --num-experts (a dense model)"),
)


def megatron_key(layer_suffix: str) -> str:
    """Stacked megatron-core key of a per-layer tensor suffix, e.g. ``input_layernorm.weight``."""
    return "decoder.layers." + _TE_NAMES.get(layer_suffix, layer_suffix)


def megatron_args(model: ModelSpec, *, tp: int, pp: int, padded_vocab: int, iteration: int) -> argparse.Namespace:
    """The subset of Megatron-LM's arguments its loader checks and our reader needs."""
    return argparse.Namespace(
        num_layers=model.num_layers, hidden_size=model.hidden_size, ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads, kv_channels=model.kv_channels,
        group_query_attention=model.num_query_groups != model.num_attention_heads,
        num_query_groups=model.num_query_groups, seq_length=model.seq_length,
        max_position_embeddings=model.max_position_embeddings, vocab_size=model.vocab_size,
        padded_vocab_size=padded_vocab, make_vocab_size_divisible_by=128,
        swiglu=model.swiglu, untie_embeddings_and_output_weights=model.untie_embeddings_and_output_weights,
        normalization=model.normalization, position_embedding_type=model.position_embedding_type,
        add_position_embedding=True,  # Megatron's default; False (--no-position-embedding) fails its validate_args
        add_bias_linear=model.add_bias_linear, add_qkv_bias=model.add_qkv_bias, qk_layernorm=model.qk_layernorm,
        apply_layernorm_1p=model.layernorm_zero_centered_gamma, squared_relu=model.squared_relu,
        rotary_interleaved=model.rotary_interleaved,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, ckpt_format="torch_dist",
        iteration=iteration, consumed_train_samples=0,
        rotary_base=model.rotary_base, rotary_percent=model.rotary_percent,
        layernorm_epsilon=model.layernorm_epsilon, init_method_std=model.init_method_std,
        **{arg.name: arg.value for arg in FIXED_ARGS},  # what the runtime builds, for --use-checkpoint-args
    )


def model_from_megatron_args(args: object, *, source: str) -> ModelSpec:
    """ModelSpec from a checkpoint's ``args``; refuses recipes the runtime does not build."""
    if args is None:
        raise ConvertError(f"{source}: the checkpoint has no 'args'. Fix: pass --model M.yaml describing it")
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    if get("vocab_size") is None:
        raise ConvertError(f"{source}: args.vocab_size is not recorded (Megatron-LM keeps only padded_vocab_size "
                           f"{get('padded_vocab_size')} when a tokenizer sets it). Fix: pass --model M.yaml with the "
                           f"unpadded vocab_size")
    swiglu = bool(get("swiglu", False))
    recipe = recipe_of(swiglu)  # a checkpoint without these args predates them: Megatron's flags were the recipe's
    architecture = {"normalization": get("normalization", recipe["normalization"]),
                    "position_embedding_type": get("position_embedding_type", recipe["position_embedding_type"]),
                    "add_bias_linear": bool(get("add_bias_linear", recipe["add_bias_linear"])),
                    "add_qkv_bias": bool(get("add_qkv_bias", False)), "qk_layernorm": bool(get("qk_layernorm", False)),
                    "layernorm_zero_centered_gamma": bool(get("apply_layernorm_1p", False)),
                    "squared_relu": bool(get("squared_relu", False))}
    for key, choices in (("normalization", NORMALIZATIONS), ("position_embedding_type", POSITION_EMBEDDING_TYPES)):
        if architecture[key] not in choices:
            raise ConvertError(f"not implemented: megatron-het builds {key} {' or '.join(choices)} only",
                               field=f"args.{key}", value=architecture[key], file=source,
                               fix=f"convert a checkpoint trained with one of {', '.join(choices)}")
    rope = architecture["position_embedding_type"] == "rope"
    if architecture["position_embedding_type"] == "learned_absolute" and get("add_position_embedding", True) is False:
        raise ConvertError("learned positions without a position embedding (--no-position-embedding; Megatron-LM "
                           "refuses it without rope)", field="args.add_position_embedding", value=False,
                           file=source, fix="convert a checkpoint trained with --position-embedding-type none or rope")
    for arg in FIXED_ARGS:
        if arg.rope and not rope:
            continue  # learned positions: rotary settings are recorded but unused
        value = get(arg.name, arg.value)
        if value != arg.value:
            raise ConvertError(f"not implemented: {arg.what}; megatron-het's runtime builds {arg.name}="
                               f"{arg.value!r} only (ModelSpec has no such setting)",
                               field=f"args.{arg.name}", value=value, file=source,
                               fix=f"convert a checkpoint trained {arg.trained}")
    # Megatron-LM's own names (its --norm-epsilon is stored as layernorm_epsilon)
    tuned = {"kv_channels": get("kv_channels"), "init_method_std": get("init_method_std"),
             "layernorm_epsilon": get("layernorm_epsilon", get("norm_epsilon"))}  # dropout: the run's flags
    if rope:  # rotary positions: the recorded base, share count and pairing
        tuned.update(rotary_base=get("rotary_base"), rotary_percent=get("rotary_percent"),
                     rotary_interleaved=get("rotary_interleaved"))
    return ModelSpec(**{k: v for k, v in tuned.items() if v is not None}, **architecture, num_layers=int(get("num_layers")), hidden_size=int(get("hidden_size")),
                     num_attention_heads=int(get("num_attention_heads")),
                     num_query_groups=int(get("num_query_groups")) if get("group_query_attention") else None,
                     ffn_hidden_size=get("ffn_hidden_size"), seq_length=int(get("seq_length")),
                     max_position_embeddings=get("max_position_embeddings"), vocab_size=int(get("vocab_size")),
                     swiglu=swiglu, untie_embeddings_and_output_weights=bool(get("untie_embeddings_and_output_weights")))


def _iteration_dir(path: str) -> tuple[str, int | None]:
    from megatron_het.checkpoint.dist_ckpt import TRACKER, iteration_dir, latest_iteration, resolve_iteration_dir

    tracked = latest_iteration(path) if os.path.isdir(path) else None  # refuses a tracker that holds no number
    if tracked is not None:
        return resolve_iteration_dir(iteration_dir(path, tracked)), tracked
    if os.path.exists(os.path.join(path, "metadata.json")):
        return path, None
    raise ConvertError(f"{path}: neither a Megatron-LM save directory ({TRACKER}) nor an iter_XXXXXXX directory "
                       f"of a torch_dist checkpoint. Fix: point --input at the --save directory")


def read_megatron(path: str, *, model: ModelSpec | None = None,
                  progress: ProgressCallback | None = None) -> ModelState:
    """Model weights of a Megatron-LM torch_dist checkpoint (TP/PP as saved; any)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_het.checkpoint.dist_ckpt import FORMAT as HET_FORMAT
    from megatron_het.checkpoint.safe_read import (
        load_common_state,
        load_sharded,
        load_tensor_metadata,
        verify_checkpoint,
    )

    src, tracked = _iteration_dir(path)
    verify_checkpoint(src)  # before the process group: no code from the checkpoint runs, damage is named
    with single_process_group():
        common = load_common_state(src)
        if common.get("format") == HET_FORMAT:
            raise ConvertError(f"{src}: a megatron-het checkpoint, not a Megatron-LM one. Fix: pass "
                               f"--input-format het")
        model = model or model_from_megatron_args(common.get("args"), source=src)
        meta = load_tensor_metadata(src)
        wanted = _wanted_keys(model)
        request = {}
        for key, shape in wanted.items():
            if key not in meta:
                raise ConvertError(f"{src}: missing tensor {key!r}. Fix: check that the checkpoint is complete and "
                                   f"that the model description matches it (swiglu, untied output layer, layers)")
            got = tuple(meta[key].global_shape)
            vocab = key in VOCAB_ROWS
            if (got[1:] if vocab else got) != (shape[1:] if vocab else shape):
                raise ConvertError(f"{src}: tensor {key!r} has global shape {got}, the model needs {shape}"
                                   f"{' (rows: padded vocabulary)' if vocab else ''}. Fix: use the model "
                                   f"description the checkpoint was trained with")
            request[key] = ShardedTensor.from_rank_offsets(key, torch.empty(got, dtype=meta[key].dtype))
        loaded = load_sharded(request, src)
    tensors: dict[str, torch.Tensor] = {}
    suffixes = {megatron_key(s): s for s in layer_shapes(model)}
    keys = [k for k in loaded if k in wanted]  # load() also returns the common state (args, iteration)
    for key in counted(keys, len(keys), progress):
        value = loaded[key]
        if key in suffixes:
            for i in range(model.num_layers):
                tensors[f"decoder.layers.{i}.{suffixes[key]}"] = value[i].clone()
        else:
            tensors[key] = unpad_vocab(value, model.vocab_size, name=key) if key in VOCAB_ROWS else value
    iteration = common.get("iteration", tracked or 0)
    tokenizer = os.path.join(src, TOKENIZER_MODEL)  # ours (write_megatron); Megatron-LM keeps none
    state = ModelState(model=model, tensors=tensors, iteration=int(iteration),
                       tokenizer_model=tokenizer if os.path.isfile(tokenizer) else None)
    check_state(state, source=src)
    return state


def _wanted_keys(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    """megatron-core key -> global shape (vocabulary rows unpadded) of every model tensor."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in expected_shapes(model).items():
        if not name.startswith("decoder.layers."):
            out[name] = shape
    for suffix, shape in layer_shapes(model).items():
        out[megatron_key(suffix)] = (model.num_layers, *shape)
    return out


def build_full_model(model: ModelSpec, padded_vocab: int, full: Mapping[str, torch.Tensor]):
    """A TP=1 megatron-core GPTModel holding ``full`` (needs a one-rank process group); returns (gpt, pgc)."""
    from megatron_het.checkpoint.full_state import load_full_state
    from megatron_het.model.gpt import StageModelSpec, build_gpt_stage, transformer_config
    from megatron_het.model.groups import BlockShape, block_process_groups

    _, pgc = block_process_groups(BlockShape(tp=1, pp=1, dp=1))
    spec = StageModelSpec(model=model, num_layers=model.num_layers, layer_offset=0, tp=1, pre_process=True,
                          post_process=True, vocab_size=padded_vocab)
    gpt = build_gpt_stage(spec, transformer_config(spec), pgc)
    load_full_state(gpt, full, layer_offset=0, tp_rank=0, tp_size=1, tied=not model.untie_embeddings_and_output_weights)
    return gpt, pgc


def write_megatron(state: ModelState, save_dir: str, *, tp: int = 1, pp: int = 1,
                   progress: ProgressCallback | None = None) -> str:
    """``save_dir/iter_XXXXXXX`` + ``latest_checkpointed_iteration.txt``; vocabulary padded for ``tp``."""
    from megatron.core import dist_checkpointing

    from megatron_het.checkpoint.dist_ckpt import TRACKER, iteration_dir
    from megatron_het.perf.flops import padded_vocab_size

    check_state(state, source="input")
    m = state.model
    padded = padded_vocab_size(m.vocab_size, tp=tp)
    if progress is not None:
        progress(0, len(state.tensors))
    full = {n: pad_vocab(t, padded, name=n) if n in VOCAB_ROWS else t for n, t in state.tensors.items()}
    final = iteration_dir(save_dir, state.iteration)
    with single_process_group():
        gpt, pgc = build_full_model(m, padded, full)
        sharded = gpt.sharded_state_dict(metadata={"dp_cp_group": pgc.dp_cp})
        os.makedirs(final)
        dist_checkpointing.save({"model": sharded, "checkpoint_version": CHECKPOINT_VERSION,
                                 "iteration": state.iteration,
                                 "args": megatron_args(m, tp=tp, pp=pp, padded_vocab=padded,
                                                       iteration=state.iteration)}, final)
    if state.tokenizer_model is not None:  # an extra file Megatron-LM ignores; read back by read_megatron
        with open(state.tokenizer_model, "rb") as f:
            write_bytes_atomic(os.path.join(final, TOKENIZER_MODEL), f.read())
    write_text_atomic(os.path.join(save_dir, TRACKER), str(state.iteration))
    if progress is not None:  # one save writes every tensor: counted once it is on disk
        progress(len(state.tensors), len(state.tensors))
    return final


__all__ = ["read_megatron", "write_megatron", "megatron_args", "model_from_megatron_args", "megatron_key",
           "build_full_model", "CHECKPOINT_VERSION"]
