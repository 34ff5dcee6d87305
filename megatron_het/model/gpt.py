"""megatron-core GPTModel for one stage, built from a ModelSpec and explicit process groups.

The stage is an ordinary megatron-core ``GPTModel`` holding ``num_layers`` of the model's layers
(``pre_process`` = it owns the embedding, ``post_process`` = the output layer and loss). Its layers
are numbered from 1 inside the stage; ``layer_offset`` maps them to global indices for
checkpoints. transformer-engine's layer spec is used when it is importable on a GPU; otherwise
megatron-core's local spec, or with sequence parallelism ``tp/spec.sequence_parallel_block_spec``
(the local spec's torch norms refuse sequence parallelism without Apex).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import megatron_het.platform  # noqa: F401  (installs the triton import guard before megatron imports)
from megatron_het.cluster import ModelSpec
from megatron_het.errors import UserError
from megatron_het.platform import detect_optional_accelerators


@dataclass(frozen=True, kw_only=True)
class StageModelSpec:
    """What one stage builds: a slice of a model under a tensor-parallel size."""

    model: ModelSpec  # the whole model
    num_layers: int  # transformer layers in this stage
    layer_offset: int  # global index of the stage's first layer
    tp: int  # tensor-parallel size of this stage
    pre_process: bool  # holds the embedding (first stage of its replica)
    post_process: bool  # holds the final norm, output layer and loss (last stage)
    vocab_size: int  # padded vocabulary, identical on every stage of every replica
    params_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False  # the plan's flag; megatron's config turns it on only where tp > 1
    recompute: bool = False  # full activation recomputation of every layer of the stage
    # with recompute: 0 every layer, N > 0 only the first N layers of this chunk (megatron-core's
    # recompute_method "block"; StagePlan.recompute_num_layers)
    recompute_num_layers: int = 0
    # Megatron's --transformer-impl: "transformer_engine" or "local"; None: transformer-engine where
    # it is importable on a GPU, else megatron-core's local spec (always local on CPU)
    transformer_impl: str | None = None
    # the local spec's core attention through torch SDPA (Plan.attention "fused") or megatron-core's
    # unfused module ("unfused"); None: SDPA on GPUs, unfused on the host (layer_spec)
    fused_attention: bool | None = None
    deterministic: bool = False  # megatron-core's deterministic_mode (--deterministic-mode)
    # MoE: routed experts spread over ``ep`` ranks, each expert's weights over ``etp`` (None: ``tp``)
    # (plan/experts.py: the plan's expert grid)
    ep: int = 1
    etp: int | None = None


def transformer_config(spec: StageModelSpec, *, pp: int = 1, cpu_initialization: bool = True,
                       initialize: bool = True):
    """megatron-core TransformerConfig for a stage: the ModelSpec's architecture and dropout.

    ``cpu_initialization``: the full weight initialised on the host then split (same values for any
    TP; the CPU path); False on GPUs, where megatron-core initialises each shard on the current device.
    ``initialize`` False: megatron-core allocates the parameters without drawing values (the trainers
    load every value afterwards: runtime/initial_values.py or a checkpoint's). The output projections'
    scaled init uses the whole model's layer count (Megatron-LM's), not the stage's."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.utils import scaled_init_method_normal

    m = spec.model
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups or m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        kv_channels=m.kv_channels,
        init_method_std=m.init_method_std,
        layernorm_epsilon=m.layernorm_epsilon,
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=spec.sequence_parallel and spec.tp > 1,
        params_dtype=spec.params_dtype,
        pipeline_dtype=spec.params_dtype,
        use_cpu_initialization=cpu_initialization,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        normalization=m.normalization,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        layernorm_zero_centered_gamma=m.layernorm_zero_centered_gamma,
        rotary_interleaved=m.rotary_interleaved,
        bf16=spec.params_dtype == torch.bfloat16,
        fp16=spec.params_dtype == torch.float16,
        perform_initialization=initialize,
        deterministic_mode=spec.deterministic,
    )
    if m.is_moe:
        kwargs.update(moe_kwargs(m), expert_model_parallel_size=spec.ep,
                      expert_tensor_parallel_size=spec.etp or spec.tp)
    if m.swiglu:
        kwargs.update(gated_linear_unit=True, activation_func=F.silu)
    elif m.squared_relu:
        from megatron.core.activations import squared_relu

        kwargs.update(activation_func=squared_relu)
    if spec.recompute and spec.recompute_num_layers:
        kwargs.update(recompute_granularity="full", recompute_method="block",
                      recompute_num_layers=min(spec.recompute_num_layers, spec.num_layers))
    elif spec.recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config = TransformerConfig(**kwargs)
    # megatron-core scales by config.num_layers, the stage's here: the whole model's, as Megatron-LM
    config.output_layer_init_method = scaled_init_method_normal(config.init_method_std, m.num_layers)
    return config


def moe_kwargs(m: ModelSpec) -> dict[str, object]:
    """megatron-core TransformerConfig fields of an MoE model: ModelSpec's MoE fields carry
    TransformerConfig's names, but for ``num_experts`` (``num_moe_experts``). The expert grid (EP,
    expert-TP) is the stage's, set by ``transformer_config``."""
    from megatron_het.cluster.model_moe import MOE_FIELDS

    return {"num_moe_experts": m.num_experts, **{f: getattr(m, f) for f in MOE_FIELDS}}


TRANSFORMER_IMPLS = ("local", "transformer_engine")


class TransformerImplError(UserError):
    """--transformer-impl names a layer implementation this process cannot build."""


def layer_spec(model: ModelSpec, *, sequence_parallel: bool = False, num_layers: int = 0, layer_offset: int = 0,
               transformer_impl: str | None = None, fused_attention: bool | None = None):
    """transformer-engine spec (``transformer_impl`` "transformer_engine", or None where TE is
    importable on a GPU), else megatron-core's local spec; with ``sequence_parallel`` (the config's
    flag: TP > 1) the local spec with norms that accept it, as a block spec of ``num_layers`` layers.
    The local spec's core attention is torch's SDPA (``model/sdpa_attention.py``) where
    ``fused_attention`` (None: on GPUs, where the planner prices fused attention; the host keeps
    megatron-core's unfused attention, which the CPU parity suites were measured with).
    An MoE model gets a block spec of the stage's ``num_layers`` layers from global layer
    ``layer_offset``: megatron-core's MoE layer where ``ModelSpec.moe_layers`` says so (experts as its
    SequentialMLP, one weight pair per expert, so checkpoints name each expert alike on every
    platform), its dense MLP elsewhere."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    te = detect_optional_accelerators().transformer_engine
    if transformer_impl == "transformer_engine" and not te:
        raise TransformerImplError("--transformer-impl transformer_engine: transformer-engine is not importable on "
                                   "a GPU in this process (got transformer_engine). Fix: pass --transformer-impl "
                                   "local, or install transformer-engine on the GPU nodes")
    pattern = model.moe_layers()[layer_offset:layer_offset + num_layers]
    if transformer_impl == "transformer_engine" or (transformer_impl is None and te):
        def te_layer(experts: bool):
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                num_experts=model.num_experts if experts else None, moe_grouped_gemm=False,
                qk_layernorm=model.qk_layernorm)

        if not model.is_moe:
            return te_layer(False)
        from megatron.core.extensions.transformer_engine import TENorm

        return TransformerBlockSubmodules(layer_specs=[te_layer(e) for e in pattern], layer_norm=TENorm)
    if model.layernorm_zero_centered_gamma:  # megatron-core's torch norms assert it away (torch_norm.py:45)
        raise TransformerImplError("--apply-layernorm-1p: megatron-core's local layer spec has no zero-centred norm "
                                   "(its torch norms refuse layernorm_zero_centered_gamma). Fix: run with "
                                   "transformer-engine (--transformer-impl transformer_engine on GPUs), or drop "
                                   "--apply-layernorm-1p")
    if fused_attention is None:
        from megatron_het.platform import detect_accelerator

        fused_attention = detect_accelerator().is_gpu

    def local_layer(experts: bool):
        spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=model.num_experts if experts else None,
                                                        normalization=model.normalization,
                                                        qk_layernorm=model.qk_layernorm)
        if fused_attention:
            from megatron_het.model.sdpa_attention import with_sdpa

            spec = with_sdpa(spec)
        return spec

    if sequence_parallel:
        from megatron_het.tp.spec import sequence_parallel_block_spec

        return sequence_parallel_block_spec([local_layer(e) for e in pattern] if model.is_moe
                                            else [local_layer(False)] * num_layers)
    if not model.is_moe:
        return local_layer(False)
    from megatron.core.transformer.transformer_block import LayerNormImpl  # the dense block's final norm

    return TransformerBlockSubmodules(layer_specs=[local_layer(e) for e in pattern], layer_norm=LayerNormImpl)


def build_gpt_stage(spec: StageModelSpec, config, pg_collection, *, device=None):
    """The stage's GPTModel on ``device`` (the accelerator's; None: where megatron-core built it);
    ``config`` from ``transformer_config``; groups passed explicitly."""
    from megatron.core.models.gpt import GPTModel

    m = spec.model
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(m, sequence_parallel=config.sequence_parallel,
                                          num_layers=spec.num_layers, layer_offset=spec.layer_offset,
                                          transformer_impl=spec.transformer_impl,
                                          fused_attention=spec.fused_attention),
        vocab_size=spec.vocab_size,
        max_sequence_length=m.max_position_embeddings or m.seq_length,
        pre_process=spec.pre_process,
        post_process=spec.post_process,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent,
        pg_collection=pg_collection,
    )
    if config.qk_layernorm and spec.tp > 1:
        # each TP rank normalises its own heads with the shared q/k norm weights: their gradients are
        # partial sums, summed over TP like sequence-parallel norms' (megatron-core's
        # finalize_model_grads sums both; runtime/grad_sync.py reads this mark)
        for name, p in gpt.named_parameters():
            if "q_layernorm" in name or "k_layernorm" in name:
                p.sequence_parallel = True
    return gpt if device is None else gpt.to(device)
