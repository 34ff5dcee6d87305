"""The weight of megatron-core's MoE auxiliary losses in the backward, as this runtime scales the loss.

megatron-core's router adds its load-balancing and z-losses through ``MoEAuxLossAutoScaler``, whose
backward feeds each one the gradient ``main_loss_backward_scale`` (a process-wide tensor). Megatron's
schedule sets it to (fp16 loss scale) / (its replica's micro-batches), and DDP then averages the
replicas. Here every micro-batch's loss is already its share of the global mean and gradients are
summed over replicas (uneven micro-batches per replica), so the auxiliary losses weigh
(loss scale) / (the global batch's micro-batches): the same total gradient as one process.
"""

from __future__ import annotations

import torch

import megatron_het.platform  # noqa: F401  (the triton import guard, before megatron imports)


def set_aux_loss_scale(*, grad_scale: torch.Tensor | None, total_micro_batches: int,
                       device: torch.device | None) -> None:
    """Set megatron-core's auxiliary-loss gradient for the next iteration (before its first forward)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # shape [1], as Megatron's schedule stores it: the first call fixes the shape later calls copy into
    scale = (torch.ones(1, dtype=torch.float32, device=device) if grad_scale is None
             else grad_scale.detach().float().reshape(1))
    MoEAuxLossAutoScaler.set_loss_scale(scale / total_micro_batches)
