"""FLOPs and parameter counts of a GPT-style model, from the shapes of its GEMMs.

Conventions:
- One multiply-accumulate is 2 FLOPs; a GEMM producing an ``m x n`` output from a ``k``-deep
  reduction costs ``2*m*n*k`` FLOPs. Element-wise work (norms, softmax, activations) is not
  counted, as in Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC21, appendix "Floating-Point Operations").
- Backward costs twice the forward (one GEMM for the input gradient, one for the weight gradient).
  Full recomputation adds one more forward of every layer; selective recomputation
  (Korthikanti et al. 2022) adds only the attention-core GEMMs (scores and context).
- The embedding lookup is a gather: 0 FLOPs. The output layer (logits) is a ``h x V`` GEMM.
- Sizes are per tensor-parallel rank when ``tp`` is given: heads, query groups, the MLP width and
  the vocabulary are split ``tp`` ways (column/row-parallel linears, vocab-parallel output).

Architecture: the ModelSpec's ``normalization`` (LayerNorm has a bias), ``add_bias_linear`` /
``add_qkv_bias``, ``position_embedding_type`` (only learned positions have parameters),
``qk_layernorm`` and ``swiglu`` (fc1 twice as wide). The GPT and Llama recipes reproduce the
published parameter counts (GPT-3 175B, Llama-2-7B); see the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from megatron_het.cluster import ConfigError, ModelSpec

__all__ = [
    "Recompute",
    "RECOMPUTE_MODES",
    "BACKWARD_TO_FORWARD",
    "Gemm",
    "check_recompute",
    "check_tp",
    "layer_gemms",
    "mlp_widths",
    "routed_expert_parameters_per_rank",
    "router_parameters",
    "logits_gemm",
    "layer_forward_flops",
    "logits_forward_flops",
    "layer_training_flops",
    "model_flops_per_iteration",
    "padded_vocab_size",
    "layer_parameters",
    "layer_parameters_per_rank",
    "embedding_parameters",
    "output_parameters",
    "final_norm_parameters",
    "total_parameters",
    "stage_parameters",
    "word_embedding_parameters_per_rank",
]

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")
BACKWARD_TO_FORWARD = 2  # backward FLOPs / forward FLOPs for a GEMM (input grad + weight grad)

_ATTENTION_CORE = ("attention_scores", "attention_context")  # what selective recompute redoes


@dataclass(frozen=True, kw_only=True)
class Gemm:
    """One (possibly batched) matrix multiply ``[m, k] @ [k, n]`` of the forward pass."""

    name: str  # which part of the layer: "qkv", "attention_scores", "attention_context", "projection", "fc1", "fc2", "logits"
    m: int  # rows of the output (tokens, or query positions for attention)
    n: int  # columns of the output
    k: int  # reduction depth
    batch: int = 1  # independent GEMMs of this shape (micro-batch x heads for attention)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.batch

    @property
    def smallest_dim(self) -> int:
        """What limits tile utilisation on a GPU; used by the efficiency curve in compute.py."""
        return min(self.m, self.n, self.k)

    @property
    def bytes_moved(self) -> int:
        """bf16 bytes read (both operands) and written (output) if nothing stays in cache."""
        return 2 * (self.m * self.k + self.k * self.n + self.m * self.n) * self.batch


def check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError("unknown activation recomputation mode", field="recompute", value=recompute,
                          fix=f"use one of: {', '.join(RECOMPUTE_MODES)}")


def check_tp(model: ModelSpec, tp: int) -> None:
    """Megatron requires heads, query groups and the MLP width to split evenly over ``tp``."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError("must be an integer >= 1", field="tp", value=tp,
                          fix="use a tensor-parallel size of 1 or more")
    moe = ("moe_ffn_hidden_size",) if model.is_moe else ()
    shared = ("moe_shared_expert_intermediate_size",) if model.moe_shared_expert_intermediate_size else ()
    for field in ("num_attention_heads", "num_query_groups", "ffn_hidden_size", *moe, *shared):
        size = getattr(model, field)
        if size % tp:
            raise ConfigError(f"{field}={size} is not divisible by tp={tp}", field="tp", value=tp,
                              fix=f"choose a tensor-parallel size that divides {field} ({size})")


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("must be an integer >= 1", field=name, value=value, fix=f"pass a positive {name}")


def _seq(model: ModelSpec, seq_length: int | None) -> int:
    s = model.seq_length if seq_length is None else seq_length
    _positive("seq_length", s)
    return s


def _norm_params(model: ModelSpec, width: int | None = None) -> int:
    """LayerNorm has weight and bias; RMSNorm only a weight (of ``width``, default h)."""
    width = model.hidden_size if width is None else width
    return 2 * width if model.normalization == "LayerNorm" else width


def replicated_layer_parameters(model: ModelSpec) -> int:
    """Parameters of one layer every TP rank holds whole: the norms (q/k norms too) and the
    row-parallel biases (attention output and fc2)."""
    return ((2 * model.hidden_size if model.add_bias_linear else 0) + _layer_norm_params(model)
            + router_parameters(model))


def _layer_norm_params(model: ModelSpec) -> int:
    """One layer's norms: the two before attention and MLP, and the q/k norms (head-wide) if any."""
    qk_norms = 2 * _norm_params(model, model.kv_channels) if model.qk_layernorm else 0
    return 2 * _norm_params(model) + qk_norms


def mlp_widths(model: ModelSpec) -> tuple[int, int]:
    """(width each token runs through, width held) of a layer's MLP. Dense: ``ffn_hidden_size`` both.
    MoE: a token runs ``moe_router_topk`` experts and the shared expert; the layer holds every expert.
    Every layer of an MoE model is priced as an MoE layer (an upper bound with ``moe_layer_freq`` > 1),
    and routing as balanced (each expert gets ``topk / num_experts`` of the tokens): imbalance is the
    load-balancing loss's to bound, not the model's."""
    if not model.is_moe:
        return model.ffn_hidden_size, model.ffn_hidden_size
    shared = model.moe_shared_expert_intermediate_size or 0
    return (model.moe_router_topk * model.moe_ffn_hidden_size + shared,
            model.num_experts * model.moe_ffn_hidden_size + shared)


def router_parameters(model: ModelSpec) -> int:
    """An MoE layer's router weight, ``num_experts x h``, whole on every TP rank (0 for a dense model)."""
    return model.num_experts * model.hidden_size if model.is_moe else 0


def _learned_positions(model: ModelSpec) -> bool:
    return model.position_embedding_type == "learned_absolute"  # rotary and none have no parameters


def layer_gemms(model: ModelSpec, *, micro_batch_size: int, seq_length: int | None = None,
                tp: int = 1) -> tuple[Gemm, ...]:
    """The forward GEMMs of one transformer layer on one tensor-parallel rank."""
    _positive("micro_batch_size", micro_batch_size)
    check_tp(model, tp)
    b, s, h, d = micro_batch_size, _seq(model, seq_length), model.hidden_size, model.kv_channels
    heads = model.num_attention_heads // tp
    groups = model.num_query_groups // tp
    f = mlp_widths(model)[0] // tp  # MoE: the routed experts' widths a token runs through
    tokens = b * s
    fc1_width = 2 * f if model.swiglu else f  # swiglu's fc1 produces gate and up halves
    router = (Gemm(name="router", m=tokens, n=model.num_experts, k=h),) if model.is_moe else ()
    return router + (
        Gemm(name="qkv", m=tokens, n=(heads + 2 * groups) * d, k=h),
        Gemm(name="attention_scores", m=s, n=s, k=d, batch=b * heads),  # Q @ K^T per head
        Gemm(name="attention_context", m=s, n=d, k=s, batch=b * heads),  # softmax(QK^T) @ V
        Gemm(name="projection", m=tokens, n=h, k=heads * d),
        Gemm(name="fc1", m=tokens, n=fc1_width, k=h),
        Gemm(name="fc2", m=tokens, n=h, k=f),
    )


def logits_gemm(model: ModelSpec, *, micro_batch_size: int, seq_length: int | None = None,
                tp: int = 1) -> Gemm:
    """Output layer GEMM on one rank; the vocabulary is split over ``tp`` (rounded up)."""
    _positive("micro_batch_size", micro_batch_size)
    check_tp(model, tp)
    s = _seq(model, seq_length)
    return Gemm(name="logits", m=micro_batch_size * s, n=math.ceil(model.vocab_size / tp), k=model.hidden_size)


def layer_forward_flops(model: ModelSpec, *, micro_batch_size: int, seq_length: int | None = None,
                        tp: int = 1) -> int:
    """Forward FLOPs of one layer on one rank; equals ``24bsh^2 + 4bs^2h`` for plain GPT, tp=1."""
    return sum(g.flops for g in layer_gemms(model, micro_batch_size=micro_batch_size,
                                            seq_length=seq_length, tp=tp))


def logits_forward_flops(model: ModelSpec, *, micro_batch_size: int, seq_length: int | None = None,
                         tp: int = 1) -> int:
    """Forward FLOPs of the output layer on one rank: ``2*b*s*h*V/tp``."""
    return logits_gemm(model, micro_batch_size=micro_batch_size, seq_length=seq_length, tp=tp).flops


def layer_training_flops(model: ModelSpec, *, micro_batch_size: int, seq_length: int | None = None,
                         tp: int = 1, recompute: Recompute = "none") -> int:
    """Forward + backward (+ recomputation) FLOPs of one layer for one micro-batch on one rank."""
    check_recompute(recompute)
    gemms = layer_gemms(model, micro_batch_size=micro_batch_size, seq_length=seq_length, tp=tp)
    forward = sum(g.flops for g in gemms)
    extra = {"none": 0, "full": forward,
             "selective": sum(g.flops for g in gemms if g.name in _ATTENTION_CORE)}[recompute]
    return (1 + BACKWARD_TO_FORWARD) * forward + extra


def model_flops_per_iteration(model: ModelSpec, *, global_batch_size: int, seq_length: int | None = None,
                              recompute: Recompute = "none") -> int:
    """FLOPs of one training iteration over ``global_batch_size`` sequences, whole model.

    With ``recompute="none"`` this is the "model FLOPs" used for MFU and, for a GPT shape,
    equals ``72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))``; with ``"full"`` it is the hardware FLOPs
    ``96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))`` of Narayanan et al. 2021, eq. (3).
    """
    _positive("global_batch_size", global_batch_size)
    layers = model.num_layers * layer_training_flops(model, micro_batch_size=global_batch_size,
                                                     seq_length=seq_length, recompute=recompute)
    logits = (1 + BACKWARD_TO_FORWARD) * logits_forward_flops(model, micro_batch_size=global_batch_size,
                                                              seq_length=seq_length)
    return layers + logits


def padded_vocab_size(vocab_size: int, *, tp: int = 1, divisible_by: int = 128) -> int:
    """Megatron-LM pads the vocabulary to a multiple of ``divisible_by * tp``
    (``--make-vocab-size-divisible-by``, default 128). Counts here use the size as given; call
    this first to count the padded embedding exactly as Megatron allocates it."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def layer_parameters_per_rank(model: ModelSpec, *, tp: int = 1, ep: int = 1, etp: int | None = None) -> int:
    """Parameters of one layer held by one tensor-parallel rank.

    Column-parallel linears (QKV, fc1) split weight and bias; row-parallel ones (projection, fc2)
    split the weight and replicate the bias; norms are replicated. An MoE layer's routed experts are
    spread over ``ep`` ranks and each split over ``etp`` (None: ``tp``; plan/experts.py), its shared
    expert over ``tp``.
    """
    check_tp(model, tp)
    h, d = model.hidden_size, model.kv_channels
    qkv_out = (model.num_attention_heads + 2 * model.num_query_groups) * d // tp
    proj_in = model.num_attention_heads * d // tp
    gate = 2 if model.swiglu else 1
    shared = (model.moe_shared_expert_intermediate_size or 0) // tp
    mlp_cols = shared if model.is_moe else model.ffn_hidden_size // tp  # a dense MLP, or the shared expert
    mlp = (gate + 1) * h * mlp_cols + ((gate * mlp_cols + h) if model.add_bias_linear and mlp_cols else 0)
    attention = h * qkv_out + proj_in * h
    attention_biases = (qkv_out + h) if model.add_bias_linear else (qkv_out if model.add_qkv_bias else 0)
    # norms and an MoE router are replicated: whole on every rank
    return (attention + attention_biases + mlp + routed_expert_parameters_per_rank(model, tp=tp, ep=ep, etp=etp)
            + _layer_norm_params(model) + router_parameters(model))


def routed_expert_parameters_per_rank(model: ModelSpec, *, tp: int = 1, ep: int = 1, etp: int | None = None) -> int:
    """One MoE layer's routed experts on one rank: ``num_experts / ep`` experts, each split over ``etp``
    (None: ``tp``), fc1 (and its bias) split, fc2's bias whole (0 for a dense model)."""
    if not model.is_moe:
        return 0
    gate = 2 if model.swiglu else 1
    experts = model.num_experts // ep
    cols = experts * model.moe_ffn_hidden_size // (etp or tp)
    return (gate + 1) * model.hidden_size * cols + ((gate * cols + experts * model.hidden_size)
                                                    if model.add_bias_linear else 0)


def layer_parameters(model: ModelSpec) -> int:
    """Parameters of one transformer layer (GPT: ``12h^2 + 13h``)."""
    return layer_parameters_per_rank(model, tp=1)


def embedding_parameters(model: ModelSpec) -> int:
    """Word embeddings ``V*h`` plus learned position embeddings (GPT recipe only)."""
    positions = model.max_position_embeddings * model.hidden_size if _learned_positions(model) else 0
    return model.vocab_size * model.hidden_size + positions


def output_parameters(model: ModelSpec) -> int:
    """The separate output layer ``V*h`` when untied; 0 when it shares the word embeddings."""
    return model.vocab_size * model.hidden_size if model.untie_embeddings_and_output_weights else 0


def final_norm_parameters(model: ModelSpec) -> int:
    return _norm_params(model)


def total_parameters(model: ModelSpec) -> int:
    """Unique parameters of the whole model (tied weights counted once)."""
    return (model.num_layers * layer_parameters(model) + embedding_parameters(model)
            + final_norm_parameters(model) + output_parameters(model))


def word_embedding_parameters_per_rank(model: ModelSpec, *, tp: int = 1) -> int:
    """One tensor-parallel rank's rows of the vocab-parallel word embeddings (or of the untied output
    layer): ``ceil(V / tp) * h``."""
    return math.ceil(model.vocab_size / tp) * model.hidden_size


def stage_parameters(model: ModelSpec, *, num_layers: int, is_first: bool, is_last: bool, tp: int = 1,
                     ep: int = 1, etp: int | None = None) -> int:
    """Parameters held by one tensor-parallel rank of a pipeline stage.

    The first stage holds the vocab-parallel word embeddings (``V/tp`` rows) and the replicated
    position embeddings; the last stage holds the final norm and the output layer. With tied
    weights and more than one stage, Megatron keeps a copy of the word embeddings on the last
    stage too (its gradient is all-reduced with the first stage's), so it is counted there.
    ``ep``/``etp``: an MoE plan's expert grid (``layer_parameters_per_rank``).
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise ConfigError("must be an integer >= 0", field="num_layers", value=num_layers,
                          fix="pass the number of transformer layers in the stage")
    check_tp(model, tp)
    h = model.hidden_size
    rows = word_embedding_parameters_per_rank(model, tp=tp)
    total = num_layers * layer_parameters_per_rank(model, tp=tp, ep=ep, etp=etp)
    if is_first:
        total += rows + (embedding_parameters(model) - model.vocab_size * h)
    if is_last:
        total += final_norm_parameters(model)
        if model.untie_embeddings_and_output_weights or not is_first:
            total += rows
    return total
