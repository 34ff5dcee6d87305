"""The mixture-of-experts fields of a ModelSpec: Megatron-LM's MoE flags, checked before any rank starts.

Only what megatron-core's MoE layers run on every platform is accepted; each refusal names the value
and the fix (megatron-core's own checks would fail later, on every rank, or at the first forward).
"""

from __future__ import annotations

from typing import Any

from megatron_het.cluster.errors import ConfigError
from megatron_het.cluster.fields import as_bool, as_float, as_int

__all__ = ["LOAD_BALANCING_TYPES", "MOE_FIELDS", "ROUTER_SCORE_FUNCTIONS", "TOKEN_DISPATCHERS", "TOKEN_DROP_POLICIES",
           "check_moe", "moe_layer_pattern"]

# --moe-router-load-balancing-type values whose loss is a function of one micro-batch's tokens on one
# stage (global_aux_loss sums statistics over data-parallel replicas; quantile_balancing keeps an EMA
# state megatron-core updates outside the layer: neither is run here yet)
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
TOKEN_DISPATCHERS = ("allgather", "alltoall")  # "flex" needs DeepEP/HybridEP kernels (GPU only)
TOKEN_DROP_POLICIES = ("probs", "position")
ROUTER_SCORE_FUNCTIONS = ("softmax", "sigmoid")
# ModelSpec fields that exist only for MoE models (None/default on a dense model)
MOE_FIELDS = ("moe_ffn_hidden_size", "moe_router_topk", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
              "moe_z_loss_coeff", "moe_token_dispatcher_type", "moe_layer_freq", "moe_shared_expert_intermediate_size",
              "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_token_drop_policy",
              "moe_router_pre_softmax", "moe_router_score_function", "moe_router_topk_scaling_factor")


def moe_layer_pattern(num_layers: int, freq: int) -> tuple[bool, ...]:
    """Which global layers hold experts: Megatron-LM's ``--moe-layer-freq N`` (every N-th layer from layer 0)."""
    return tuple(i % freq == 0 for i in range(num_layers))


def check_moe(m: Any, defaults: dict[str, object]) -> None:
    """Validate the MoE fields of ModelSpec ``m`` (num_experts None: a dense model, and every MoE field
    must keep its default, ``defaults``)."""
    if m.num_experts is None:
        for f, default in defaults.items():
            if getattr(m, f) != default:
                raise ConfigError("is an MoE setting, but the model has no experts", field=f, value=getattr(m, f),
                                  fix="add num_experts (--num-experts), or drop it")
        return
    n = as_int(m.num_experts, "num_experts", maximum=65_536)
    as_int(m.moe_ffn_hidden_size, "moe_ffn_hidden_size", maximum=4_194_304)
    if not 1 <= as_int(m.moe_router_topk, "moe_router_topk") <= n:
        raise ConfigError(f"must be at most num_experts {n}", field="moe_router_topk", value=m.moe_router_topk,
                          fix=f"route each token to between 1 and {n} experts")
    for f, choices in (("moe_router_load_balancing_type", LOAD_BALANCING_TYPES),
                       ("moe_token_dispatcher_type", TOKEN_DISPATCHERS),
                       ("moe_token_drop_policy", TOKEN_DROP_POLICIES),
                       ("moe_router_score_function", ROUTER_SCORE_FUNCTIONS)):
        if getattr(m, f) not in choices:
            raise ConfigError(f"must be one of {', '.join(choices)}", field=f, value=getattr(m, f),
                              fix=f"use {choices[0]} (Megatron-LM's default)")
    as_float(m.moe_aux_loss_coeff, "moe_aux_loss_coeff", inclusive=True)
    if m.moe_router_load_balancing_type == "sinkhorn" and m.moe_aux_loss_coeff:
        raise ConfigError("sinkhorn routing balances without an auxiliary loss (megatron-core asserts, router.py:295)",
                          field="moe_aux_loss_coeff", value=m.moe_aux_loss_coeff, fix="use 0 with sinkhorn")
    if (m.moe_router_topk == 1 and m.moe_router_score_function == "softmax" and not m.moe_router_pre_softmax
            and m.moe_router_load_balancing_type != "sinkhorn"):
        raise ConfigError("a softmax over one selected expert has a zero gradient (megatron-core refuses it, "
                          "transformer_config.py:2336)", field="moe_router_pre_softmax", value=False,
                          fix="add --moe-router-pre-softmax (moe_router_pre_softmax: true), or route to 2+ experts")
    if m.moe_z_loss_coeff is not None:
        as_float(m.moe_z_loss_coeff, "moe_z_loss_coeff", inclusive=True)
    if m.moe_router_topk_scaling_factor is not None:
        as_float(m.moe_router_topk_scaling_factor, "moe_router_topk_scaling_factor")
    freq = as_int(m.moe_layer_freq, "moe_layer_freq")
    if freq > m.num_layers:
        raise ConfigError(f"must be at most num_layers {m.num_layers}", field="moe_layer_freq", value=freq,
                          fix="use 1 (every layer has experts) or a divisor of num_layers")
    if m.moe_shared_expert_intermediate_size is not None:
        as_int(m.moe_shared_expert_intermediate_size, "moe_shared_expert_intermediate_size", maximum=4_194_304)
        if m.add_bias_linear:  # megatron-core asserts it (transformer/moe/shared_experts.py:124)
            raise ConfigError("a shared expert has no linear biases in megatron-core", field="add_bias_linear",
                              value=True, fix="add --disable-bias-linear, or drop the shared expert")
    for f in ("moe_pad_expert_input_to_capacity", "moe_router_pre_softmax"):
        as_bool(getattr(m, f), f)
    if m.moe_expert_capacity_factor is not None:
        as_float(m.moe_expert_capacity_factor, "moe_expert_capacity_factor")
        if m.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "none"):
            raise ConfigError("token dropping (moe_expert_capacity_factor) works only with aux_loss, seq_aux_loss "
                              "or none (megatron-core)", field="moe_router_load_balancing_type",
                              value=m.moe_router_load_balancing_type, fix="use aux_loss")
    elif m.moe_pad_expert_input_to_capacity:
        raise ConfigError("pads to a capacity, but moe_expert_capacity_factor is not set",
                          field="moe_pad_expert_input_to_capacity", value=True,
                          fix="set moe_expert_capacity_factor (--moe-expert-capacity-factor), or drop it")
