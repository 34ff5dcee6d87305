"""What a parallelism strategy implements for the one trainer, and the types they share.

A strategy (pipeline: ``runtime/hetero_trainer.py``, sharded: ``sharding/trainer.py``, plain
megatron-core: ``runtime/megatron_trainer.py``) owns the model, its process groups, its optimizer
and one iteration's work; the trainer (``train/trainer.py``) owns the iteration counter, the hooks,
the timer and the logs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from megatron_het.train.readout import Readout

if TYPE_CHECKING:
    from megatron_het.cluster import ModelSpec
    from megatron_het.platform import MemoryStats
    from megatron_het.train.timer import EmulationTimer

# global parameter name -> checkpoint.full_state.Shard (this rank's piece of the full tensor)
Shards = Mapping[str, Any]

# batch_fn(iteration, sample_indices) -> LongTensor [len(indices), seq_length + 1]
BatchFn = Callable[[int, range], torch.Tensor]
# on_action(index, action): called before each schedule action of an iteration (fault injection)
ActionHook = Callable[[int, object], None]


MOE_KEY = "moe:"  # prefix of the MoE losses' names in a Readout


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What a strategy's step reports; the trainer adds the timing common to every strategy."""

    # lm_loss, grad_norm, loss_scale: Python numbers or one-element device tensors, which the trainer
    # reads once per log interval (train/readout.py): a step must not wait for the device to report them
    lm_loss: float | torch.Tensor | None  # mean token loss over the global batch (None where the rank does not see it)
    grad_norm: float | torch.Tensor  # global gradient norm before clipping
    comm_s: float = 0.0  # collectives over the training state (sharded: gather, reduce-scatter, norm)
    optimizer_s: float = 0.0  # the optimizer step, where a strategy measures it apart
    skipped: bool = False  # fp16: the step was skipped (gradients overflowed at this loss scale)
    loss_scale: float | torch.Tensor | None = None  # fp16: the loss scale the step ran with (None: no scaling)
    params_norm: float | torch.Tensor | None = None  # --log-params-norm: global parameter norm after the step
    num_zeros: float | torch.Tensor | None = None  # --log-num-zeros-in-grad: zero gradient elements, world-wide
    # MoE models: each router loss the model records (runtime/moe_metrics.py), mean per MoE layer and micro-batch
    moe_losses: Mapping[str, float | torch.Tensor] | None = None


@dataclass(frozen=True, kw_only=True)
class IterationLog:
    """What one rank saw of one iteration."""

    iteration: int  # 1-based, as Megatron logs it
    consumed_samples: int | None = None  # training samples read after this iteration (None: iteration * global batch)
    # lm_loss (mean token loss over the global batch; None: not known on this rank), grad_norm (global
    # gradient norm before clipping) and loss_scale (StepResult.loss_scale), read from the device at
    # the log interval (properties below)
    readout: Readout
    elapsed_s: float  # wall time of the step on this rank
    compute_s: float = 0.0  # forward + backward, emulated slowdown included
    emulated_s: float = 0.0  # of which (plus the optimizer's): waiting to emulate a slower device
    comm_s: float = 0.0  # StepResult.comm_s
    optimizer_s: float = 0.0  # StepResult.optimizer_s
    tokens_per_s: float = 0.0  # global batch tokens / elapsed_s
    skipped: bool = False  # StepResult.skipped
    memory: MemoryStats | None = None  # this rank's memory after the step (GPU: allocator; CPU: RSS)

    @property
    def lm_loss(self) -> float | None:
        return self.readout.get("lm_loss")

    @property
    def grad_norm(self) -> float:
        return self.readout.get("grad_norm")

    @property
    def loss_scale(self) -> float | None:
        return self.readout.get("loss_scale")

    @property
    def params_norm(self) -> float | None:
        return self.readout.get("params_norm")

    @property
    def num_zeros(self) -> float | None:
        return self.readout.get("num_zeros")

    @property
    def moe_losses(self) -> dict[str, float]:
        """The MoE routers' losses of the step (StepResult.moe_losses; empty for a dense model)."""
        return {k.removeprefix(MOE_KEY): self.readout.get(k) for k in self.readout.keys() if k.startswith(MOE_KEY)}

    @property
    def idle_s(self) -> float:
        """Time not spent computing (waiting for neighbours, collectives, optimizer)."""
        return max(0.0, self.elapsed_s - self.compute_s)


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """A rank's outcome of a training run."""

    rank: int
    iterations: tuple[IterationLog, ...]
    initial_shards: Shards | None  # parameters before the first step, if requested
    shards: Shards | None  # final parameters as global-named shards, if requested
    routes: tuple = ()  # (ranks, "native" | "het-bridge") of this rank's gradient groups


class Strategy(Protocol):
    """One parallelism strategy behind the trainer; every method is collective over the strategy's ranks."""

    model_spec: ModelSpec  # the model trained
    rank: int  # this process's rank in the current world
    reports_shards: bool  # this rank's shards() go into RunResult (one copy per tensor is enough)

    # One optimizer step on the global batch of 0-based ``iteration``. A failure must leave the
    # optimizer un-stepped on every rank, so the trainer can redo the iteration.
    def step(self, iteration: int, *, lr: float, timer: EmulationTimer,
             on_action: ActionHook | None) -> StepResult: ...

    # Forward-only mean loss of one global batch from ``batch_fn``.
    def evaluate(self, batch_fn: BatchFn, iteration: int) -> float: ...

    # Write the state after ``iteration`` steps under ``save``; returns the iteration directory.
    def save_checkpoint(self, save: str, iteration: int, *, tokenizer_model: str | None = None) -> str: ...

    # Load a checkpoint written under any plan; returns its iteration.
    def load_checkpoint(self, path: str, *, with_optimizer: bool = True) -> int: ...

    # Current parameters as global-named shards.
    def shards(self) -> Shards: ...

    # Every holder of each parameter holds the same value (runtime/consistency.py; collective): the
    # number of cells compared, or an error on every rank naming what differs. ``context`` prefixes it.
    def check_weights(self, context: str) -> int: ...

    # Where the time went over ``logs``: the lines on global rank 0, [] elsewhere.
    def summary_lines(self, logs: Sequence[IterationLog]) -> list[str]: ...
