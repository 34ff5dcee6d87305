"""The one interpreter of schedule actions: F, B (fused, or input-gradient only), W, send/recv.

Used by the pipeline strategy for the plan's schedule and, after a failure, for resilience's routed
schedule. Micro-batches are *global* indices: micro-batch g reads samples [g x mbs, (g + 1) x mbs) of
the iteration's global batch and moves through ``links[g]`` (its pipeline's neighbours); the pipeline
strategy offsets the plan schedule's per-replica indices once (``globalise``).

With ``split_backward`` (routed schedules), B computes only the input gradient, sent upstream at
once, and W the weight gradients later by re-traversing the retained graph: the same sums as the
fused backward. The last stage fuses B and W (megatron's vocab-parallel cross-entropy backward
reuses its saved softmax in place, so the loss node cannot be traversed twice). Without it (the
plan's schedules today) B computes both gradients and W is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from megatron_het.runtime.boundary import BoundaryLink
from megatron_het.schedule import Action
from megatron_het.train.strategy import ActionHook, BatchFn
from megatron_het.train.timer import EmulationTimer

# forward(tokens or None, input activation or None) -> activation, or on a last stage the
# micro-batch's share of the global-batch mean loss
ForwardFn = Callable[[torch.Tensor | None, torch.Tensor | None], torch.Tensor]


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor | None) -> None:
    """B: accumulate d(out)/d(inp) into ``inp.grad`` only (nothing to do without an input)."""
    if inp is not None:
        torch.autograd.backward(out, grad_tensors=grad, inputs=[inp], retain_graph=True)


def backward_weight(out: torch.Tensor, grad: torch.Tensor | None, params: Sequence[torch.Tensor]) -> None:
    """W: accumulate the weight gradients into ``p.grad`` and free the graph."""
    torch.autograd.backward(out, grad_tensors=grad, inputs=list(params))


def grad_reduce_trigger(actions: Sequence[Action], *, split_backward: bool = False) -> int | None:
    """Index of the action before which an overlapped gradient synchronizer is armed: the last
    action computing weight gradients (the last B, or with split backward the last W)."""
    kinds = ("W",) if split_backward and any(a.kind == "W" for a in actions) else ("B", "BW")
    backward = [i for i, a in enumerate(actions) if a.kind in kinds]
    return backward[-1] if backward else None


def globalise(actions: Sequence[Action], first_micro_batch: int) -> tuple[Action, ...]:
    """A replica's action list with global micro-batch indices (its micro-batches start at ``first_micro_batch``)."""
    return tuple(Action(kind=a.kind, micro_batch=first_micro_batch + a.micro_batch, chunk=a.chunk) for a in actions)


class ActionExecutor:
    """Runs one rank's action list over global micro-batches, each sent through its pipeline's link."""

    def __init__(self, *, actions: Sequence[Action], links: Mapping[int, BoundaryLink], is_first: bool,
                 is_last: bool, act_shape: tuple[int, int, int], dtype: torch.dtype, micro_batch_size: int,
                 loss_scale: float, split_backward: bool = False, arm: Callable[[], None] | None = None,
                 device: torch.device | None = None) -> None:
        self.actions = tuple(actions)  # this rank's actions, execution order, global micro-batches
        self.links = dict(links)  # global micro-batch -> the link to its neighbours
        self.is_first, self.is_last = is_first, is_last
        self.act_shape, self.dtype = act_shape, dtype  # full [s, b, h] boundary activation
        self.micro_batch_size = micro_batch_size
        self.loss_scale = loss_scale  # a last stage's forward returns loss / loss_scale (global mean share)
        self.split = split_backward and not is_last  # see the module docstring
        self.arm = arm  # an overlapped synchronizer's arm(): called before the last weight-gradient action
        self.trigger = grad_reduce_trigger(self.actions, split_backward=self.split) if arm is not None else None
        self.samples: list[int] = []  # sample indices this rank read in the last run (accounting)
        self.device = device  # the accelerator's device: the loss accumulator lives there (None: host)
        self.grad_scale: torch.Tensor | None = None  # fp16 loss scale a last stage multiplies its loss by

    def micro_batches(self) -> list[int]:
        """Global micro-batches this rank runs per iteration."""
        return sorted(self.links)

    def _tokens(self, batch_fn: BatchFn, iteration: int, g: int, *, record: bool) -> torch.Tensor | None:
        if not (self.is_first or self.is_last):
            return None
        rng = range(g * self.micro_batch_size, (g + 1) * self.micro_batch_size)
        if record:
            self.samples += list(rng)
        return batch_fn(iteration, rng)

    def run(self, *, iteration: int, batch_fn: BatchFn, forward: ForwardFn, params: Sequence[torch.Tensor],
            timer: EmulationTimer, on_action: ActionHook | None = None) -> torch.Tensor:
        """One iteration's actions; returns the local loss sum (last stages: sum of micro-batch means)."""
        first, last = self.is_first, self.is_last
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        out_grads: dict[int, torch.Tensor | None] = {}
        # accumulated on the device: no host sync per micro-batch (read once per iteration)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.samples = []
        try:
            for index, action in enumerate(self.actions):
                if on_action is not None:
                    on_action(index, action)
                g, link = action.micro_batch, self.links[action.micro_batch]
                if action.kind == "F":
                    tokens = self._tokens(batch_fn, iteration, g, record=True)
                    inp = None if first else link.recv_forward(self.act_shape, self.dtype, g).requires_grad_()
                    out = timer.compute(lambda: forward(tokens, inp))
                    if last:
                        loss_sum += out.detach().double() * self.loss_scale
                    else:
                        link.send_forward(out.detach(), g)
                    saved[g] = (inp, out)
                elif action.kind in ("B", "BW"):
                    inp, out = saved[g]
                    grad = None if last else link.recv_backward(self.act_shape, out.dtype, g)
                    if last and self.grad_scale is not None:
                        out = out * self.grad_scale  # the backward of the scaled loss (fp16)
                    if index == self.trigger:  # buckets start reducing as this backward completes them
                        self.arm()
                    if self.split and action.kind == "B":
                        timer.compute(lambda: backward_input(out, grad, inp))
                        out_grads[g] = grad
                    else:
                        timer.compute(lambda: torch.autograd.backward(out, grad_tensors=grad))
                        saved.pop(g)
                    if not first:
                        link.send_backward(inp.grad, g)
                elif action.kind == "W":
                    if g not in out_grads:
                        continue  # fused into B: autograd computed both gradients together
                    if index == self.trigger:
                        self.arm()
                    inp, out = saved.pop(g)
                    grad = out_grads.pop(g)
                    timer.compute(lambda: backward_weight(out, grad, params))
                else:
                    raise ValueError(f"unknown schedule action {action}")
            for link in set(self.links.values()):
                link.drain()
        except BaseException:
            for link in set(self.links.values()):
                link.abandon()  # a failed iteration's sends are abandoned with the group
            raise
        return loss_sum

    @torch.no_grad()
    def evaluate(self, *, iteration: int, batch_fn: BatchFn, forward: ForwardFn) -> torch.Tensor:
        """Forward-only loss sum of one global batch (forwards in micro-batch order: no deadlock)."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in self.micro_batches():
            link = self.links[g]
            tokens = self._tokens(batch_fn, iteration, g, record=False)
            inp = None if self.is_first else link.recv_forward(self.act_shape, self.dtype, g)
            out = forward(tokens, inp)
            if self.is_last:
                loss_sum += out.double() * self.loss_scale
            else:
                link.send_forward(out, g)
        for link in set(self.links.values()):
            link.drain()
        return loss_sum
