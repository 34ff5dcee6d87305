"""A megatron-core local layer spec that allows sequence parallelism without Apex.

megatron-core 0.19.2's local spec uses ``WrappedTorchNorm`` when Apex is absent (always on CPU),
and it refuses ``sequence_parallel`` (``transformer/torch_norm.py:50``), although a torch norm is
correct under sequence parallelism as long as its weight gradients are summed over the TP group —
which ``finalize_model_grads`` does for every parameter marked ``sequence_parallel``
(``distributed/finalize_model_grads.py:452``), exactly as Apex's ``FusedLayerNorm`` marks them.
Sequence parallelism is what the TP overlap path needs (``comm/overlap_megatron.py``);
``runtime/gpt_model.build_gpt_stage`` uses this spec on every stage whose config has it on.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SequenceParallelTorchNorm", "sequence_parallel_block_spec"]


class SequenceParallelTorchNorm:
    """``WrappedTorchNorm`` without the sequence-parallel refusal; marks the norm's parameters."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> torch.nn.Module:
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"config.normalization: {config.normalization!r} is not supported here. "
                             f"Fix: use LayerNorm or RMSNorm")
        if config.sequence_parallel:  # finalize_model_grads all-reduces these over the TP group
            for p in norm.parameters():
                p.sequence_parallel = True
        return norm


def swap_module_class(spec: Any, old: type, new: type) -> Any:
    """A copy of a ModuleSpec tree with every ``old`` module class replaced by ``new``."""
    import dataclasses

    if spec is old:
        return new
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: swap_module_class(getattr(spec, f.name), old, new) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    if isinstance(spec, (list, tuple)):  # a block spec's layer_specs
        return type(spec)(swap_module_class(item, old, new) for item in spec)
    return spec


def sequence_parallel_block_spec(layer_specs: list):
    """``TransformerBlockSubmodules`` for ``GPTModel(transformer_layer_spec=...)``: megatron-core's
    local layer specs (one per layer of the stage: dense, or MoE) with sequence-parallel-capable torch
    norms in the layers and the final norm."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layers = [swap_module_class(spec, WrappedTorchNorm, SequenceParallelTorchNorm) for spec in layer_specs]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=SequenceParallelTorchNorm)
