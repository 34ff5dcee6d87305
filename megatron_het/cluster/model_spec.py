"""The model shape, in Megatron-LM's argument names (``--num-layers`` -> ``num_layers``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_het.cluster.errors import ConfigError
from megatron_het.cluster.fields import as_bool, as_float, as_int, as_str
from megatron_het.cluster.model_moe import MOE_FIELDS, check_moe, moe_layer_pattern

__all__ = ["MAX_SIZES", "NORMALIZATIONS", "POSITION_EMBEDDING_TYPES", "ModelSpec", "default_ffn_hidden_size",
           "recipe_of", "off_recipe"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")  # Megatron-LM's --normalization choices megatron-core builds locally
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")  # --position-embedding-type for a GPT model

# Sane bounds, far above any model trained so far: beyond them a value is a typo, and the planner and
# performance model would spend minutes or memory on it.
MAX_SIZES = {"num_layers": 10_000, "hidden_size": 1_048_576, "num_attention_heads": 65_536,
             "num_query_groups": 65_536, "ffn_hidden_size": 4_194_304, "seq_length": 16_777_216,
             "max_position_embeddings": 16_777_216, "vocab_size": 16_777_216}


def default_ffn_hidden_size(hidden_size: int, *, swiglu: bool) -> int:
    """Megatron-LM's default ``--ffn-hidden-size`` when none is given.

    4*h; with SwiGLU, 2/3 of that (the MLP has three matrices instead of two, keeping the
    parameter count) rounded DOWN to a multiple of 64, exactly as Megatron-LM's arguments.py:
    ``int((4 * h * 2 / 3) / 64) * 64``. Llama's own code rounds up to 256 instead (h=4096 ->
    11008 vs Megatron's 10880), which is why the Llama examples give ffn_hidden_size explicitly.
    """
    if swiglu:
        return int((4 * hidden_size * 2 / 3) / 64) * 64
    return 4 * hidden_size


def recipe_of(swiglu: bool) -> dict[str, object]:
    """The architecture ``swiglu`` names: Llama's (True) or GPT-2's (False), in ModelSpec's field names."""
    return {"normalization": "RMSNorm" if swiglu else "LayerNorm",
            "position_embedding_type": "rope" if swiglu else "learned_absolute",
            "add_bias_linear": not swiglu, "add_qkv_bias": False, "qk_layernorm": False,
            "layernorm_zero_centered_gamma": False, "squared_relu": False, "rotary_interleaved": False}


def off_recipe(model: ModelSpec) -> dict[str, object]:
    """The model's architecture fields that differ from the recipe of its ``swiglu`` (formats that
    know only the GPT-2 and Llama layouts refuse these)."""
    return {f: getattr(model, f) for f, want in recipe_of(model.swiglu).items() if getattr(model, f) != want}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A GPT-style decoder's shape. None defaults are resolved in __post_init__."""

    num_layers: int  # transformer layers
    hidden_size: int  # model width h
    num_attention_heads: int  # query heads; must divide hidden_size
    num_query_groups: int | None = None  # key/value heads (GQA); None -> num_attention_heads (no GQA)
    ffn_hidden_size: int | None = None  # MLP width; None -> default_ffn_hidden_size(hidden_size, swiglu)
    seq_length: int  # tokens per sample
    max_position_embeddings: int | None = None  # None -> seq_length; must be >= seq_length
    vocab_size: int  # tokenizer vocabulary, unpadded (Megatron pads it for tensor parallelism)
    swiglu: bool = False  # gated SiLU MLP (Llama) instead of GeLU
    untie_embeddings_and_output_weights: bool = False  # separate output layer weights (Llama)
    name: str | None = None  # display name, e.g. "llama2-7b"
    # Megatron-LM's model flags of the same names, passed to megatron-core's TransformerConfig/GPTModel:
    kv_channels: int | None = None  # per-head width; None -> hidden_size // num_attention_heads
    init_method_std: float = 0.02  # std of the normal initial weights (--init-method-std)
    rotary_base: int = 10000  # RoPE theta (--rotary-base; used where positions are rotary)
    rotary_percent: float = 1.0  # share of each head's channels that rotate (--rotary-percent)
    rotary_interleaved: bool = False  # --rotary-interleaved: rotate channel pairs (2i, 2i+1), not halves
    layernorm_epsilon: float = 1e-5  # epsilon of every LayerNorm/RMSNorm (--norm-epsilon)
    # Architecture choices, Megatron-LM's flags of the same names. None: the recipe ``swiglu`` names
    # (True: Llama's RMSNorm, rotary positions, no linear biases; False: GPT-2's LayerNorm, learned
    # positions, biases), so a model file saying only ``swiglu: true`` stays Llama
    normalization: str | None = None  # --normalization: LayerNorm or RMSNorm
    position_embedding_type: str | None = None  # --position-embedding-type: learned_absolute, rope or none
    add_bias_linear: bool | None = None  # biases of every linear layer (False: --disable-bias-linear)
    add_qkv_bias: bool = False  # --add-qkv-bias: the QKV projection keeps its bias without the others (Qwen)
    qk_layernorm: bool = False  # --qk-layernorm: each head's queries and keys normalised before attention
    layernorm_zero_centered_gamma: bool = False  # --apply-layernorm-1p: norm weights held as (weight - 1)
    squared_relu: bool = False  # --squared-relu: relu(x)^2 MLP activation instead of GeLU (not with swiglu)
    # dropout: 0 unless written (Llama's; what the parity suites measure). pretrain_gpt.py without a
    # model file takes Megatron-LM's --hidden-dropout/--attention-dropout defaults (0.1) instead
    hidden_dropout: float = 0.0  # --hidden-dropout: after attention and MLP outputs and the embedding
    attention_dropout: float = 0.0  # --attention-dropout: on the attention probabilities
    # Mixture of experts (Megatron-LM's flags of the same names; defaults are Megatron-LM's;
    # cluster/model_moe.py checks them). None: a dense model, and every moe_* field keeps its default
    num_experts: int | None = None  # routed experts per MoE layer (--num-experts)
    moe_ffn_hidden_size: int | None = None  # each expert's MLP width; None -> ffn_hidden_size (Megatron-LM's)
    moe_router_topk: int = 2  # experts each token is routed to
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss, seq_aux_loss, sinkhorn or none
    moe_aux_loss_coeff: float = 0.0  # weight of the load-balancing loss
    moe_z_loss_coeff: float | None = None  # weight of the router z-loss (None: off)
    moe_token_dispatcher_type: str = "allgather"  # how tokens reach their experts: allgather or alltoall
    moe_layer_freq: int = 1  # every N-th layer (from layer 0) has experts, the others a dense MLP
    moe_shared_expert_intermediate_size: int | None = None  # width of the shared expert every token runs
    moe_expert_capacity_factor: float | None = None  # token dropping: each expert takes at most this x its share
    moe_pad_expert_input_to_capacity: bool = False  # with a capacity: pad every expert's input to it
    moe_token_drop_policy: str = "probs"  # which tokens an over-capacity expert drops: lowest probs or last
    moe_router_pre_softmax: bool = False  # softmax over all experts before top-k (Mixtral: after)
    moe_router_score_function: str = "softmax"  # softmax or sigmoid scores
    moe_router_topk_scaling_factor: float | None = None  # scale of the top-k routing probabilities

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
            as_int(getattr(self, f), f, maximum=MAX_SIZES[f])
        as_bool(self.swiglu, "swiglu")
        as_bool(self.untie_embeddings_and_output_weights, "untie_embeddings_and_output_weights")
        if self.name is not None:
            as_str(self.name, "name")
        as_float(self.init_method_std, "init_method_std")
        as_int(self.rotary_base, "rotary_base")
        as_float(self.layernorm_epsilon, "layernorm_epsilon")
        if not 0 < as_float(self.rotary_percent, "rotary_percent") <= 1:
            raise ConfigError("must be in (0, 1]", field="rotary_percent", value=self.rotary_percent,
                              fix="use 1.0 (every channel rotates) or a fraction such as 0.5")
        self._resolve_architecture()
        defaults = {
            "num_query_groups": self.num_attention_heads,
            "ffn_hidden_size": default_ffn_hidden_size(self.hidden_size, swiglu=self.swiglu),
            "max_position_embeddings": self.seq_length,
        }
        for f, default in defaults.items():
            value = getattr(self, f)
            object.__setattr__(self, f, default if value is None else as_int(value, f, maximum=MAX_SIZES[f]))

        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)  # Megatron-LM's default
        check_moe(self, {f.name: f.default for f in dataclasses.fields(self) if f.name in MOE_FIELDS})
        h, heads, groups = self.hidden_size, self.num_attention_heads, self.num_query_groups
        if self.kv_channels is not None:
            object.__setattr__(self, "kv_channels", as_int(self.kv_channels, "kv_channels",
                                                           maximum=MAX_SIZES["hidden_size"]))
        elif h % heads:
            raise ConfigError(f"hidden_size {h} is not divisible by num_attention_heads {heads}",
                              field="num_attention_heads", value=heads,
                              fix=f"pick a head count that divides {h}, e.g. {_divisor_near(h, heads)}")
        else:
            object.__setattr__(self, "kv_channels", h // heads)
        if heads % groups:
            raise ConfigError(f"num_attention_heads {heads} is not divisible by num_query_groups {groups}",
                              field="num_query_groups", value=groups,
                              fix=f"pick a group count that divides {heads}, e.g. {_divisor_near(heads, groups)}")
        if self.max_position_embeddings < self.seq_length:
            raise ConfigError(f"must be >= seq_length {self.seq_length}", field="max_position_embeddings",
                              value=self.max_position_embeddings,
                              fix=f"raise it to at least {self.seq_length} or lower seq_length")


    @property
    def is_moe(self) -> bool:
        """The model has mixture-of-experts layers."""
        return self.num_experts is not None

    def moe_layers(self) -> tuple[bool, ...]:
        """Per global layer: True where the MLP is megatron-core's MoE layer (all False for a dense model)."""
        if self.num_experts is None:
            return (False,) * self.num_layers
        return moe_layer_pattern(self.num_layers, self.moe_layer_freq)

    def _resolve_architecture(self) -> None:
        """The recipe of ``swiglu`` for architecture fields left None; every choice validated."""
        for f, value in recipe_of(self.swiglu).items():
            if getattr(self, f) is None:
                object.__setattr__(self, f, value)
        for f, choices in (("normalization", NORMALIZATIONS), ("position_embedding_type", POSITION_EMBEDDING_TYPES)):
            if getattr(self, f) not in choices:
                raise ConfigError(f"must be one of {', '.join(choices)}", field=f, value=getattr(self, f),
                                  fix=f"use {choices[0]} or {choices[1]}")
        for f in ("add_bias_linear", "add_qkv_bias", "qk_layernorm", "layernorm_zero_centered_gamma", "squared_relu",
                  "rotary_interleaved"):
            as_bool(getattr(self, f), f)
        for f in ("hidden_dropout", "attention_dropout"):
            if not as_float(getattr(self, f), f, inclusive=True) < 1:
                raise ConfigError("must be in [0, 1)", field=f, value=getattr(self, f),
                                  fix="use 0.0 (no dropout) or Megatron-LM's 0.1")
        if self.swiglu and self.squared_relu:
            raise ConfigError("swiglu and squared_relu are two MLP activations (Megatron-LM refuses both)",
                              field="squared_relu", value=True, fix="keep one of swiglu and squared_relu")


def _divisor_near(n: int, target: int) -> int:
    """The divisor of ``n`` closest to ``target`` (ties go to the smaller), for fix hints."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - target), d))
