"""AdamW on one rank's flat shard of the training state (both sharded modes use this one class).

A shard boundary may cut a parameter anywhere, so the update is written on flat tensors whose
elements come in *runs*: contiguous ranges that share Megatron-LM's group settings (weight decay
except on biases and 1-D parameters; ``--decoupled-lr`` on the embedding and output layer). Each
run steps with its group's scalars, exactly torch.optim.AdamW's single-tensor step (so a sharded
run matches an unsharded one to round-off), in slices of at most ``CHUNK`` elements: the update's
temporaries (``sqrt(v)``, the denominator) are one slice's, not the shard's, and no per-element
mask is held beside the state. State is three flat fp32 tensors and one step counter, which is
what the checkpoint gathers and re-slices into any other shard layout.

Used by the sharded strategy (Cephalo mode, ``sharding/trainer.py``: one flat vector of the whole
model) and by the pipeline runtime's distributed optimizer (``optim/distributed.py``: pieces of
the full tensors each rank holds).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from megatron_het.optim.layout import FlatIndex
from megatron_het.train.config import TrainConfig

__all__ = ["CHUNK", "Run", "ShardedAdamW", "decay_runs", "decays", "merge_runs"]

CHUNK = 1 << 22  # elements per slice of the update: 16 MiB of fp32 temporaries, whatever the shard


def decays(name: str, shape: tuple[int, ...]) -> bool:
    """Megatron-LM's rule: weight decay except on biases and 1-D parameters (norms)."""
    return not (len(shape) == 1 or name.endswith(".bias"))


@dataclass(frozen=True, kw_only=True)
class Run:
    """Contiguous shard elements with one group's settings."""

    start: int  # first element in the shard
    stop: int  # one past the last
    decays: bool  # weight decay applies (Megatron's groups: not on biases and 1-D parameters)
    decoupled: bool = False  # takes --decoupled-lr (word embedding, output layer)


def merge_runs(runs: Iterable[Run]) -> tuple[Run, ...]:
    """``runs`` in order with neighbours of equal settings joined (fewer, longer slices to step)."""
    out: list[Run] = []
    for r in runs:
        if r.stop == r.start:
            continue
        last = out[-1] if out else None
        if last is not None and last.stop == r.start and (last.decays, last.decoupled) == (r.decays, r.decoupled):
            out[-1] = Run(start=last.start, stop=r.stop, decays=r.decays, decoupled=r.decoupled)
        else:
            out.append(r)
    return tuple(out)


def decay_runs(index: FlatIndex, shapes: dict[str, tuple[int, ...]], start: int, stop: int) -> tuple[Run, ...]:
    """The runs of the flat range [start, stop) of ``index`` (offsets relative to ``start``)."""
    return merge_runs(Run(start=seg.shard_start, stop=seg.shard_start + seg.numel, decays=decays(seg.name, shapes[seg.name]))
                      for seg in index.segments(start, stop))


@dataclass
class ShardedAdamW:
    """Master weights, moments and the step count of one shard (mutable: it is the optimizer)."""

    master: torch.Tensor  # fp32 master weights of the shard, 1-D
    runs: Sequence[Run]  # the shard's elements in order, each run with its group's settings
    train: TrainConfig  # betas, eps, weight decay
    exp_avg: torch.Tensor | None = None  # Adam first moment (zeros at start)
    exp_avg_sq: torch.Tensor | None = None  # Adam second moment (zeros at start)
    step_count: int = 0  # optimizer steps taken (bias correction)
    numel: int = field(init=False)  # elements of the shard (the runs' cover)

    def __post_init__(self) -> None:
        self.runs = merge_runs(self.runs)
        pos = 0
        for r in self.runs:
            if r.start != pos:
                raise ValueError(f"runs: run [{r.start}, {r.stop}) starts at {r.start}, expected {pos}. "
                                 "Fix: the runs must cover the shard in order without gaps")
            pos = r.stop
        if self.master.dim() != 1 or self.master.numel() != pos:
            raise ValueError(f"master: must be 1-D with the runs' {pos} elements (got shape "
                             f"{tuple(self.master.shape)}). Fix: pass the flat shard and its runs")
        self.numel = pos
        if self.exp_avg is None:
            self.exp_avg = torch.zeros_like(self.master)
        if self.exp_avg_sq is None:
            self.exp_avg_sq = torch.zeros_like(self.master)

    @torch.no_grad()
    def step(self, grad: torch.Tensor, lr: float, decoupled_lr: float | None = None) -> None:
        """One AdamW update of the shard with its (already reduced and clipped) gradient;
        ``decoupled_lr``: the rate of the ``decoupled`` runs (--decoupled-lr; None: ``lr``)."""
        if grad.shape != (self.numel,):
            raise ValueError(f"grad: shape {tuple(grad.shape)} does not match the shard ({self.numel},). "
                             "Fix: pass this rank's reduce-scattered gradient")
        t = self.train
        self.step_count += 1
        bias1 = 1.0 - t.adam_beta1 ** self.step_count
        bias2_sqrt = math.sqrt(1.0 - t.adam_beta2 ** self.step_count)
        for run in self.runs:
            rate = decoupled_lr if run.decoupled and decoupled_lr is not None else lr
            for lo in range(run.start, run.stop, CHUNK):
                hi = min(run.stop, lo + CHUNK)
                m, g = self.master[lo:hi], grad[lo:hi]
                e, v = self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi]
                if t.weight_decay and run.decays:
                    m.mul_(1.0 - rate * t.weight_decay)  # decoupled decay, as torch's AdamW
                e.lerp_(g, 1.0 - t.adam_beta1)
                v.mul_(t.adam_beta2).addcmul_(g, g, value=1.0 - t.adam_beta2)
                denom = (v.sqrt() / bias2_sqrt).add_(t.adam_eps)
                m.addcdiv_(e, denom, value=-rate / bias1)
