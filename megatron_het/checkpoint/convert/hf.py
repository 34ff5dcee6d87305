"""Hugging Face safetensors <-> the neutral form: GPT-2 layout (swiglu=False), Llama (swiglu=True).

GPT-2's Conv1D stores weights as [in, out], the transpose of megatron's Linear [out, in]; its
c_attn is [Q; K; V] while megatron interleaves per head. Llama keeps q/k/v/o and gate/up/down
apart; megatron's swiglu fc1 is [gate; up]. Rotary embeddings need no permutation: megatron-core's
default (rotary_interleaved=False) rotates halves, as HF Llama does. HF gets the unpadded vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Iterator, Mapping

import torch

from megatron_het.checkpoint.convert.errors import ConvertError
from megatron_het.checkpoint.convert.hf_tokenizer import TOKENIZER_MODEL, write_hf_tokenizer
from megatron_het.checkpoint.convert.qkv import fuse_qkv, split_qkv
from megatron_het.checkpoint.convert.state import OUTPUT_LAYER, POSITION_EMBEDDING, WORD_EMBEDDING, ModelState
from megatron_het.cluster import ModelSpec
from megatron_het.cluster.model_spec import off_recipe, recipe_of
from megatron_het.utils.atomic import write_text_atomic
from megatron_het.utils.json_file import FileProblem, read_json_file
from megatron_het.utils.progress import ProgressCallback

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
LAYERNORM_EPS = 1e-5  # megatron-core TransformerConfig.layernorm_epsilon default
ROPE_THETA = 10000.0  # megatron-core GPTModel rotary_base default
# Rotary settings of a Llama config.json, in every spelling: transformers < 5 writes top-level
# rope_theta and rope_scaling ({"rope_type" or "type": ..., "factor": ...}); transformers 5 writes
# rope_parameters ({"rope_type", "rope_theta", "partial_rotary_factor", scaling fields}).
ROPE_GROUPS = ("rope_scaling", "rope_parameters")
UNSCALED_ROPE = ("default",)  # rope_type values meaning no scaling
MAX_SHARD_BYTES = 5 * 1024**3  # HF's customary shard size
# Buffers some GPT-2 checkpoints carry (causal masks); not weights.
_GPT2_BUFFERS = (".attn.bias", ".attn.masked_bias")


def hf_config(model: ModelSpec) -> dict:
    """config.json for the model (GPT2LMHeadModel or LlamaForCausalLM)."""
    tied = not model.untie_embeddings_and_output_weights
    off = off_recipe(model)
    if off:
        field, value = next(iter(off.items()))
        arch = "Llama" if model.swiglu else "GPT-2"
        raise ConvertError(f"{field}: Hugging Face's {arch} layout has {recipe_of(model.swiglu)[field]!r} (got "
                           f"{value!r}). Fix: convert to Megatron's format (tools/checkpoint/convert.py --output-format megatron), which "
                           f"holds any architecture, or train the {arch} recipe")
    if not model.swiglu:
        if model.num_query_groups != model.num_attention_heads:
            raise ConvertError(f"num_query_groups: GPT-2 has no grouped-query attention (got {model.num_query_groups} "
                               f"groups for {model.num_attention_heads} heads). Fix: convert a model without GQA")
        if model.kv_channels * model.num_attention_heads != model.hidden_size:
            raise ConvertError(f"kv_channels: GPT-2's heads are hidden_size / heads wide (got {model.kv_channels} x "
                               f"{model.num_attention_heads} heads for hidden {model.hidden_size}). Fix: convert a "
                               "model trained without --kv-channels")
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "n_layer": model.num_layers, "n_embd": model.hidden_size, "n_head": model.num_attention_heads,
            "n_inner": model.ffn_hidden_size, "n_positions": model.max_position_embeddings,
            "vocab_size": model.vocab_size,
            "activation_function": "gelu",  # megatron's F.gelu (erf), not GPT-2's tanh "gelu_new"
            "layer_norm_epsilon": model.layernorm_epsilon, "scale_attn_weights": True,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "tie_word_embeddings": tied, "torch_dtype": "float32", "initializer_range": model.init_method_std,
        }
    if model.rotary_percent != 1.0:
        raise ConvertError("rotary_percent: Hugging Face's Llama rotates every channel of a head (got "
                           f"{model.rotary_percent}). Fix: convert a model trained with --rotary-percent 1.0")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "num_hidden_layers": model.num_layers, "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.num_query_groups,
        "head_dim": model.kv_channels, "intermediate_size": model.ffn_hidden_size,
        "max_position_embeddings": model.max_position_embeddings, "vocab_size": model.vocab_size,
        "hidden_act": "silu", "rms_norm_eps": model.layernorm_epsilon, "rope_theta": float(model.rotary_base),
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": tied, "torch_dtype": "float32",
        "initializer_range": model.init_method_std,
    }


def model_from_hf_config(config: Mapping, *, seq_length: int | None = None, source: str = CONFIG) -> ModelSpec:
    """ModelSpec of a GPT-2 or Llama config.json; settings megatron's recipe cannot express are refused."""
    kind = config.get("model_type")
    if kind == "gpt2":
        act = config.get("activation_function", "gelu_new")
        if act not in ("gelu", "gelu_new"):
            raise ConvertError(f"{source}: activation_function {act!r} is not GeLU. Fix: convert a GeLU GPT-2 model")
        if act == "gelu_new":
            print(f"warning: {source}: activation_function 'gelu_new' (tanh GeLU); megatron uses exact GeLU, "
                  "outputs will differ slightly", file=sys.stderr)
        eps = _norm_eps(config, "layer_norm_epsilon", source)
        positions = int(config.get("n_positions", 1024))
        return ModelSpec(num_layers=int(config["n_layer"]), hidden_size=int(config["n_embd"]),
                         num_attention_heads=int(config["n_head"]), ffn_hidden_size=config.get("n_inner"),
                         seq_length=seq_length or positions, max_position_embeddings=positions,
                         vocab_size=int(config["vocab_size"]), swiglu=False, layernorm_epsilon=eps,
                         init_method_std=_init_std(config, source),
                         untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", True))
    if kind == "llama":
        for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
            if config.get(key, want) != want:
                raise ConvertError(f"{source}: {key} is {config[key]!r}; megatron-het's Llama recipe has {want!r}. "
                                   f"Fix: convert a model with {key}={want!r}")
        base = _rope_base(config, source)
        eps = _norm_eps(config, "rms_norm_eps", source)
        heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
        positions = int(config.get("max_position_embeddings", 4096))
        return ModelSpec(num_layers=int(config["num_hidden_layers"]), hidden_size=hidden, num_attention_heads=heads,
                         num_query_groups=int(config.get("num_key_value_heads") or heads),
                         ffn_hidden_size=int(config["intermediate_size"]), seq_length=seq_length or positions,
                         max_position_embeddings=positions, vocab_size=int(config["vocab_size"]), swiglu=True,
                         kv_channels=int(config.get("head_dim") or hidden // heads), rotary_base=base,
                         layernorm_epsilon=eps, init_method_std=_init_std(config, source),
                         untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False))
    raise ConvertError(f"{source}: model_type {kind!r} is not supported. Fix: convert a 'gpt2' or 'llama' model")


def _rope_base(config: Mapping, source: str) -> int:
    """The rotary base of a Llama config.json in whichever spelling transformers wrote it (ModelSpec's
    rotary_base, megatron-core's rotary_base); settings megatron-het does not build are refused by
    name (field, value, fix): scaling, a partial rotary factor, per-attention-type settings."""
    found: list[tuple[str, object]] = [(k, config[k]) for k in ("rope_theta", "partial_rotary_factor") if k in config]
    for group in ROPE_GROUPS:
        params = config.get(group)
        if params is None:
            continue
        if not isinstance(params, Mapping):
            raise ConvertError("expected an object of rotary settings", field=group, value=params, file=source,
                               fix=f"write {group} as a JSON object, or drop it for megatron-core's default rotary")
        nested = [k for k, v in params.items() if isinstance(v, Mapping)]
        if nested:  # transformers 5's per-attention-type parameters (e.g. full vs sliding attention)
            raise ConvertError("rotary settings per attention type are not implemented: megatron-het runs one "
                               "rotary embedding for every layer", field=f"{group}.{nested[0]}",
                               value=params[nested[0]], file=source,
                               fix="convert a model with one set of rotary settings (a Llama config)")
        kind = "rope_type" if "rope_type" in params or "type" not in params else "type"  # "type": before 4.45
        found += [(f"{group}.{k}", params[k]) for k in (kind, "rope_theta", "partial_rotary_factor") if k in params]
    base = ROPE_THETA
    for field, value in found:
        name = field.rsplit(".", 1)[-1]
        if name in ("rope_type", "type"):
            if value not in UNSCALED_ROPE:
                raise ConvertError("rotary scaling is not implemented: megatron-het runs megatron-core's unscaled "
                                   "rotary embedding (ModelSpec has no scaling field)", field=field, value=value,
                                   file=source, fix="convert a model without rotary scaling (rope_type 'default'); "
                                                    "Llama-3.1-style scaling ('llama3'), 'linear', 'dynamic' or "
                                                    "'yarn' cannot be run here")
        elif name == "rope_theta":
            theta = _as_float(value)
            if theta is None or theta <= 0 or theta != int(theta):
                raise ConvertError("the rotary base must be a positive whole number (Megatron-LM's --rotary-base is "
                                   "an integer)", field=field, value=value, file=source,
                                   fix="convert a model whose rope_theta is a whole number, e.g. 500000")
            base = theta
        elif _as_float(value) != 1.0:
            raise ConvertError("megatron-het exports and imports models that rotate every channel of a head "
                               "(Hugging Face's Llama applies a partial factor differently)", field=field,
                               value=value, file=source, fix="convert a model with partial_rotary_factor 1.0")
    return int(base)


def _norm_eps(config: Mapping, key: str, source: str) -> float:
    """The layer-norm epsilon of a config.json (ModelSpec's layernorm_epsilon); a config without ``key``
    gets megatron-core's default (transformers writes it into every config it saves)."""
    if key not in config:
        return LAYERNORM_EPS
    eps = _as_float(config[key])
    if eps is None or not eps > 0:
        raise ConvertError("must be a positive number", field=key, value=config[key], file=source,
                           fix=f"write {key} as a number such as 1e-05")
    return eps


def _init_std(config: Mapping, source: str) -> float:
    """``initializer_range`` (Megatron's --init-method-std); megatron-core's 0.02 when absent."""
    std = _as_float(config.get("initializer_range", 0.02))
    if std is None or not std > 0:
        raise ConvertError("must be a positive number", field="initializer_range", value=config["initializer_range"],
                           file=source, fix="write initializer_range as a number such as 0.02")
    return std


def _as_float(value: object) -> float | None:
    """A config number as float; None for anything else (which then matches no accepted value)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _gpt2_layer(i: int) -> dict[str, str]:
    return {"input_layernorm": f"transformer.h.{i}.ln_1", "pre_mlp_layernorm": f"transformer.h.{i}.ln_2",
            "self_attention.linear_proj": f"transformer.h.{i}.attn.c_proj",
            "mlp.linear_fc1": f"transformer.h.{i}.mlp.c_fc", "mlp.linear_fc2": f"transformer.h.{i}.mlp.c_proj"}


def to_hf(state: ModelState) -> dict[str, torch.Tensor]:
    """Neutral form -> HF state dict (GPT-2 or Llama names)."""
    m, t = state.model, state.tensors
    out: dict[str, torch.Tensor] = {}
    if not m.swiglu:
        out["transformer.wte.weight"] = t[WORD_EMBEDDING]
        out["transformer.wpe.weight"] = t[POSITION_EMBEDDING]
        for i in range(m.num_layers):
            p = f"decoder.layers.{i}."
            for ours, theirs in _gpt2_layer(i).items():
                conv1d = "linear" in ours  # Conv1D weights are [in, out]
                out[f"{theirs}.weight"] = t[f"{p}{ours}.weight"].t() if conv1d else t[f"{p}{ours}.weight"]
                out[f"{theirs}.bias"] = t[f"{p}{ours}.bias"]
            for kind in ("weight", "bias"):
                q, k, v = split_qkv(t[f"{p}self_attention.linear_qkv.{kind}"], m)
                fused = torch.cat([q, k, v], dim=0)
                out[f"transformer.h.{i}.attn.c_attn.{kind}"] = fused.t() if kind == "weight" else fused
        out["transformer.ln_f.weight"] = t["decoder.final_layernorm.weight"]
        out["transformer.ln_f.bias"] = t["decoder.final_layernorm.bias"]
        if m.untie_embeddings_and_output_weights:
            out["lm_head.weight"] = t[OUTPUT_LAYER]
    else:
        out["model.embed_tokens.weight"] = t[WORD_EMBEDDING]
        for i in range(m.num_layers):
            p, hp = f"decoder.layers.{i}.", f"model.layers.{i}."
            q, k, v = split_qkv(t[f"{p}self_attention.linear_qkv.weight"], m)
            out.update({f"{hp}self_attn.q_proj.weight": q, f"{hp}self_attn.k_proj.weight": k,
                        f"{hp}self_attn.v_proj.weight": v})
            out[f"{hp}self_attn.o_proj.weight"] = t[f"{p}self_attention.linear_proj.weight"]
            gate, up = torch.chunk(t[f"{p}mlp.linear_fc1.weight"], 2, dim=0)
            out[f"{hp}mlp.gate_proj.weight"], out[f"{hp}mlp.up_proj.weight"] = gate, up
            out[f"{hp}mlp.down_proj.weight"] = t[f"{p}mlp.linear_fc2.weight"]
            out[f"{hp}input_layernorm.weight"] = t[f"{p}input_layernorm.weight"]
            out[f"{hp}post_attention_layernorm.weight"] = t[f"{p}pre_mlp_layernorm.weight"]
        out["model.norm.weight"] = t["decoder.final_layernorm.weight"]
        if m.untie_embeddings_and_output_weights:
            out["lm_head.weight"] = t[OUTPUT_LAYER]
    return {k: v.contiguous().clone() for k, v in out.items()}


def _take(hf: dict[str, torch.Tensor], name: str, source: str) -> torch.Tensor:
    if name not in hf:
        raise ConvertError(f"{source}: missing tensor {name!r}. Fix: check that the checkpoint is complete and "
                           f"that config.json describes it")
    return hf.pop(name)


def from_hf(tensors: Mapping[str, torch.Tensor], model: ModelSpec, *, source: str = "hf") -> ModelState:
    """HF state dict -> neutral form; a missing or left-over tensor is an error naming it."""
    hf = dict(tensors)
    if not model.swiglu and not any(k.startswith("transformer.") for k in hf):
        hf = {f"transformer.{k}" if k != "lm_head.weight" else k: v for k, v in hf.items()}  # original GPT-2 names
    hf = {k: v for k, v in hf.items() if not k.endswith(_GPT2_BUFFERS)}
    t: dict[str, torch.Tensor] = {}
    if not model.swiglu:
        t[WORD_EMBEDDING] = _take(hf, "transformer.wte.weight", source)
        t[POSITION_EMBEDDING] = _take(hf, "transformer.wpe.weight", source)
        for i in range(model.num_layers):
            p = f"decoder.layers.{i}."
            for ours, theirs in _gpt2_layer(i).items():
                w = _take(hf, f"{theirs}.weight", source)
                t[f"{p}{ours}.weight"] = w.t().contiguous() if "linear" in ours else w
                t[f"{p}{ours}.bias"] = _take(hf, f"{theirs}.bias", source)
            h = model.hidden_size
            for kind in ("weight", "bias"):
                fused = _take(hf, f"transformer.h.{i}.attn.c_attn.{kind}", source)
                fused = fused.t() if kind == "weight" else fused
                if fused.shape[0] != 3 * h:
                    raise ConvertError(f"{source}: tensor 'transformer.h.{i}.attn.c_attn.{kind}' has {fused.shape[0]} "
                                       f"output rows, the model needs {3 * h}. Fix: check config.json")
                q, k, v = torch.split(fused, h, dim=0)
                t[f"{p}self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, model)
        t["decoder.final_layernorm.weight"] = _take(hf, "transformer.ln_f.weight", source)
        t["decoder.final_layernorm.bias"] = _take(hf, "transformer.ln_f.bias", source)
    else:
        t[WORD_EMBEDDING] = _take(hf, "model.embed_tokens.weight", source)
        for i in range(model.num_layers):
            p, hp = f"decoder.layers.{i}.", f"model.layers.{i}."
            q, k, v = (_take(hf, f"{hp}self_attn.{x}_proj.weight", source) for x in "qkv")
            d, g = model.kv_channels, model.num_query_groups
            for name, x, rows in (("q_proj", q, model.num_attention_heads * d), ("k_proj", k, g * d),
                                  ("v_proj", v, g * d)):
                if x.shape[0] != rows:
                    raise ConvertError(f"{source}: tensor '{hp}self_attn.{name}.weight' has {x.shape[0]} rows, the "
                                       f"model needs {rows}. Fix: check num_key_value_heads in config.json")
            t[f"{p}self_attention.linear_qkv.weight"] = fuse_qkv(q, k, v, model)
            t[f"{p}self_attention.linear_proj.weight"] = _take(hf, f"{hp}self_attn.o_proj.weight", source)
            t[f"{p}mlp.linear_fc1.weight"] = torch.cat([_take(hf, f"{hp}mlp.gate_proj.weight", source),
                                                        _take(hf, f"{hp}mlp.up_proj.weight", source)], dim=0)
            t[f"{p}mlp.linear_fc2.weight"] = _take(hf, f"{hp}mlp.down_proj.weight", source)
            t[f"{p}input_layernorm.weight"] = _take(hf, f"{hp}input_layernorm.weight", source)
            t[f"{p}pre_mlp_layernorm.weight"] = _take(hf, f"{hp}post_attention_layernorm.weight", source)
        t["decoder.final_layernorm.weight"] = _take(hf, "model.norm.weight", source)
    if model.untie_embeddings_and_output_weights:
        t[OUTPUT_LAYER] = _take(hf, "lm_head.weight", source)
    else:
        hf.pop("lm_head.weight", None)  # a tied copy some writers include
    if hf:
        raise ConvertError(f"{source}: unexpected tensor {sorted(hf)[0]!r} ({len(hf)} left over). Fix: config.json "
                           f"does not describe this checkpoint (num layers, tie_word_embeddings?)")
    return ModelState(model=model, tensors={k: v.contiguous() for k, v in t.items()})


def write_hf(state: ModelState, out_dir: str, *, max_shard_bytes: int = MAX_SHARD_BYTES,
             progress: ProgressCallback | None = None) -> None:
    """config.json plus safetensors (one file, or shards with an index past ``max_shard_bytes``),
    and the tokenizer files when the state has a tokenizer model (hf_tokenizer.py)."""
    from safetensors.torch import save_file

    config = hf_config(state.model)
    if state.tokenizer_model is not None:  # first: a tokenizer that does not fit fails before the weights
        ids = write_hf_tokenizer(state.tokenizer_model, out_dir, vocab_size=state.model.vocab_size,
                                 max_length=state.model.max_position_embeddings)
        # generate() stops at eos and pads with pad; GPT-2's defaults (50256) are not this vocabulary
        config.update({k: v for k, v in (("bos_token_id", ids.bos_token_id), ("eos_token_id", ids.eos_token_id),
                                         ("pad_token_id", ids.pad_token_id)) if v >= 0})

    tensors = to_hf(state)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    written = 0
    for fname, shard in zip(names, shards):
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        written += len(shard)
        if progress is not None:
            progress(written, len(tensors))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {n: f for f, s in zip(names, shards) for n in s}}
        write_text_atomic(os.path.join(out_dir, INDEX), json.dumps(index, indent=2))
    write_text_atomic(os.path.join(out_dir, CONFIG), json.dumps(config, indent=2) + "\n")


@contextlib.contextmanager
def _safetensors_errors(path: str) -> Iterator[None]:
    """A damaged or foreign .safetensors file is one ConvertError naming it (safetensors parses the
    header itself and never runs code, but reports damage as its own exception type)."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConvertError(f"{path}: not a readable safetensors file ({first}). Fix: copy the model again, "
                           f"or convert a complete Hugging Face model directory") from None


def read_hf(in_dir: str, *, model: ModelSpec | None = None, progress: ProgressCallback | None = None) -> ModelState:
    """A HF model directory (config.json + *.safetensors, and the ``tokenizer.model`` an export from
    this project carries); ``model`` overrides what config.json says."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    config_path = os.path.join(in_dir, CONFIG)
    if not os.path.exists(config_path):
        from megatron_het.checkpoint.convert.het import is_het_checkpoint

        if is_het_checkpoint(in_dir):
            raise ConvertError(f"{in_dir}: a megatron-het checkpoint, not a Hugging Face model directory (no "
                               f"config.json). Fix: pass --input-format het")
    if model is None:
        if not os.path.exists(config_path):
            raise ConvertError(f"{in_dir}: no config.json. Fix: pass --model M.yaml describing the checkpoint")
        try:
            config = read_json_file(config_path)
        except FileProblem as e:
            raise ConvertError(f"{config_path}: {e}. Fix: pass a Hugging Face model directory whose config.json "
                               f"is intact, or --model M.yaml describing the checkpoint") from None
        if not isinstance(config, dict):
            raise ConvertError(f"{config_path}: expected a JSON object, found {type(config).__name__}. "
                               f"Fix: pass a Hugging Face config.json")
        model = model_from_hf_config(config, source=config_path)
    files = sorted(f for f in os.listdir(in_dir) if f.endswith(".safetensors"))
    if not files:
        raise ConvertError(f"{in_dir}: no *.safetensors files. Fix: convert a safetensors checkpoint "
                           f"(pytorch_model.bin is not read)")
    total = 0
    for fname in files:  # the headers alone give the tensor count; a damaged header fails here, cheaply
        with _safetensors_errors(os.path.join(in_dir, fname)), safe_open(os.path.join(in_dir, fname),
                                                                           framework="pt") as f:
            total += len(list(f.keys()))
    tensors: dict[str, torch.Tensor] = {}
    for fname in files:
        with _safetensors_errors(os.path.join(in_dir, fname)):
            tensors.update(load_file(os.path.join(in_dir, fname)))
        if progress is not None:
            progress(len(tensors), total)
    state = from_hf(tensors, model, source=in_dir)
    tokenizer = os.path.join(in_dir, TOKENIZER_MODEL)
    return dataclasses.replace(state, tokenizer_model=tokenizer) if os.path.isfile(tokenizer) else state
