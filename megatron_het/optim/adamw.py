"""AdamW on one rank's flat shard of the training state (both sharded modes use this one class).

A shard boundary may cut a parameter anywhere, so the update is written on flat tensors with a
per-element weight-decay mask (Megatron-LM's groups: no decay on biases and 1-D parameters). The
arithmetic is torch.optim.AdamW's single-tensor path step for step, so a sharded run matches an
unsharded one to round-off. State is three flat fp32 tensors and one step counter, which is what
the checkpoint gathers and re-slices into any other shard layout.

Used by the sharded strategy (Cephalo mode, ``sharding/trainer.py``: one flat vector of the whole
model) and by the pipeline runtime's distributed optimizer (``optim/distributed.py``: pieces of
the full tensors each rank holds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_het.optim.layout import FlatIndex
from megatron_het.train.config import TrainConfig

__all__ = ["ShardedAdamW", "decay_mask", "decays"]


def decays(name: str, shape: tuple[int, ...]) -> bool:
    """Megatron-LM's rule: weight decay except on biases and 1-D parameters (norms)."""
    return not (len(shape) == 1 or name.endswith(".bias"))


def decay_mask(index: FlatIndex, shapes: dict[str, tuple[int, ...]], start: int, stop: int, *,
               device: torch.device | None = None) -> torch.Tensor:
    """1.0 where the flat range [start, stop) holds a decayed parameter, else 0.0 (on ``device``)."""
    mask = torch.zeros(stop - start, device=device)
    for seg in index.segments(start, stop):
        if decays(seg.name, shapes[seg.name]):
            mask[seg.shard_start:seg.shard_start + seg.numel] = 1.0
    return mask


@dataclass
class ShardedAdamW:
    """Master weights, moments and the step count of one shard (mutable: it is the optimizer)."""

    master: torch.Tensor  # fp32 master weights of the shard, 1-D
    mask: torch.Tensor  # weight-decay mask, same shape
    train: TrainConfig  # betas, eps, weight decay
    exp_avg: torch.Tensor | None = None  # Adam first moment (zeros at start)
    exp_avg_sq: torch.Tensor | None = None  # Adam second moment (zeros at start)
    step_count: int = 0  # optimizer steps taken (bias correction)
    # 1.0 where the element takes --decoupled-lr (word embedding, output layer); None: no such element
    decoupled: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.master.dim() != 1 or self.mask.shape != self.master.shape:
            raise ValueError(f"master/mask: must be 1-D of one shape (got {tuple(self.master.shape)} and "
                             f"{tuple(self.mask.shape)}). Fix: pass the flat shard and its decay_mask")
        if self.exp_avg is None:
            self.exp_avg = torch.zeros_like(self.master)
        if self.exp_avg_sq is None:
            self.exp_avg_sq = torch.zeros_like(self.master)

    @torch.no_grad()
    def step(self, grad: torch.Tensor, lr: float, decoupled_lr: float | None = None) -> None:
        """One AdamW update of the shard with its (already reduced and clipped) gradient;
        ``decoupled_lr``: the rate of the ``decoupled`` elements (--decoupled-lr)."""
        if grad.shape != self.master.shape:
            raise ValueError(f"grad: shape {tuple(grad.shape)} does not match the shard {tuple(self.master.shape)}. "
                             "Fix: pass this rank's reduce-scattered gradient")
        t = self.train
        self.step_count += 1
        # a per-element rate only where some element takes another (the scalar path is torch's, exactly)
        rate = (lr if decoupled_lr is None or self.decoupled is None or decoupled_lr == lr
                else torch.lerp(torch.full_like(self.master, lr), torch.full_like(self.master, decoupled_lr),
                                self.decoupled))
        if t.weight_decay:
            self.master.mul_(1.0 - rate * t.weight_decay * self.mask)  # decoupled decay, masked per element
        self.exp_avg.lerp_(grad, 1.0 - t.adam_beta1)
        self.exp_avg_sq.mul_(t.adam_beta2).addcmul_(grad, grad, value=1.0 - t.adam_beta2)
        bias1 = 1.0 - t.adam_beta1 ** self.step_count
        bias2_sqrt = math.sqrt(1.0 - t.adam_beta2 ** self.step_count)
        denom = (self.exp_avg_sq.sqrt() / bias2_sqrt).add_(t.adam_eps)
        if isinstance(rate, torch.Tensor):
            self.master.sub_(self.exp_avg / denom * (rate / bias1))
        else:
            self.master.addcdiv_(self.exp_avg, denom, value=-rate / bias1)
