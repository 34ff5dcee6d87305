"""The MoE routers' losses of each iteration, for the log line (Megatron-LM's ``load_balancing_loss``, ``z_loss``).

megatron-core's routers record each layer's load-balancing and z-loss into a process-wide tracker
(``moe_logging.get_moe_metrics_tracker``), indexed by the layer number the router holds and sized by
the first recorder's ``config.num_layers``. A stage here is a GPTModel of its own layers (numbered
from 1, its config holding the stage's count), so the routers are renumbered with their global layer
and the tracker's entries are made model-wide before any forward; a process that builds several
trainers (tests, a re-plan) starts each from an empty tracker.

Reported as Megatron-LM does: each loss's sum over micro-batches and MoE layers, divided by the
micro-batches and the MoE layers (the mean per layer and micro-batch), summed over tensor-parallel
ranks where the router reduces its statistics over them and averaged where it averages (its entry's
``reduce_group``/``avg_group``); over replicas the division by the global batch's micro-batches
replaces Megatron's data-parallel average (uneven micro-batches per replica).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import megatron_het.platform  # noqa: F401  (the triton import guard, before megatron imports)
from megatron_het.cluster import ModelSpec

__all__ = ["AUX_LOSS_NAMES", "MOE_LOSS_NAMES", "MoEMetrics"]

# --moe-router-load-balancing-type -> the name megatron-core records its loss under
AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
MOE_LOSS_NAMES = (*AUX_LOSS_NAMES.values(), "z_loss")  # every name the log line may show, in its order


def recorded_names(model: ModelSpec) -> tuple[str, ...]:
    """The losses ``model``'s routers record, under megatron-core's conditions: a load-balancing loss
    with a coefficient above 0 (``Router.is_aux_loss_enabled``), the z-loss with any coefficient set,
    0 included (``Router.apply_z_loss``)."""
    names = []
    if model.moe_aux_loss_coeff > 0 and model.moe_router_load_balancing_type in AUX_LOSS_NAMES:
        names.append(AUX_LOSS_NAMES[model.moe_router_load_balancing_type])
    if model.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return tuple(names)


class MoEMetrics:
    """This rank's routers' losses: renumbered and tracked model-wide at construction, read once per step."""

    def __init__(self, model: ModelSpec, chunks: Sequence[tuple[torch.nn.Module, int]], *, tp_size: int,
                 device: torch.device | None) -> None:
        """``chunks``: (GPTModel, global index of its first layer) for each model chunk of this rank."""
        from megatron.core.transformer.moe.moe_logging import MetricEntry, get_moe_metrics_tracker

        self.names = recorded_names(model)
        self.tp_size = tp_size
        self.moe_layers = sum(model.moe_layers())
        self.renumber(chunks)
        self.tracker = get_moe_metrics_tracker()
        self.tracker.metrics.clear()
        for name in self.names:
            self.tracker.metrics[name] = MetricEntry(values=torch.zeros(model.num_layers, device=device))

    @staticmethod
    def renumber(chunks: Sequence[tuple[torch.nn.Module, int]]) -> None:
        """Give each MoE layer (and its router) its global layer number (after a rebuild too)."""
        for gpt, first in chunks:
            for i, layer in enumerate(getattr(getattr(gpt, "decoder", None), "layers", ())):
                if hasattr(layer.mlp, "router"):
                    layer.mlp.set_layer_number(first + i + 1)  # 1-based, as megatron-core numbers layers

    def reset(self) -> None:
        """Forget what the routers recorded (an iteration redone after a failure starts from zero)."""
        for name in self.names:
            self.tracker.metrics[name].values.zero_()

    def take_local(self) -> torch.Tensor:
        """This rank's share of each loss's world sum (``names`` order, float64), the tracker emptied."""
        out = []
        for name in self.names:
            entry = self.tracker.metrics[name]
            value = entry.values.double().sum()
            if entry.avg_group is not None and entry.reduce_group is None:
                value = value / self.tp_size  # averaged over the TP ranks: each holds its own tokens' mean
            out.append(value)
            entry.values.zero_()
        return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)

    def report(self, world_sums: torch.Tensor, total_micro_batches: int) -> dict[str, torch.Tensor]:
        """Loss name -> mean per MoE layer and micro-batch, from ``take_local``'s world sums."""
        return {name: world_sums[i] / (total_micro_batches * self.moe_layers) for i, name in enumerate(self.names)}
