"""The one interpreter of schedule actions: F, B (fused, or input-gradient only), W, send/recv.

Used by the pipeline strategy for the plan's schedule and, after a failure, for resilience's routed
schedule. Micro-batches are *global* indices: micro-batch g reads samples [g x mbs, (g + 1) x mbs) of
the iteration's global batch and moves through ``links[g]`` (its pipeline's neighbours); the pipeline
strategy offsets the plan schedule's per-replica indices once (``globalise``).

Interleaved schedules (``num_chunks`` V > 1): the rank holds V model chunks; chunk c of stage s is
virtual stage c*p + s. Saved activations are keyed by (chunk, micro-batch); chunk c > 0 moves
through ``chunk_links[c]`` (stage 0's chunk c receives from the last stage's chunk c - 1). The
first virtual stage reads tokens, the last computes the loss. Each boundary message is tagged
g*V + (chunk of its upstream side), so the chunks' messages between one pair of ranks never meet
the wrong receive.

With split backward (a schedule with W actions: zero-bubble, resilience's routed schedules) B runs
the stage's backward once, computing input gradients (sent upstream at its step) while the linears'
weight gradients wait in the stage's ``WeightGradStore`` (``split_backward.py``); W computes them.
Nothing is traversed twice, the last stage included. Without W actions B computes both.

Transfers follow ``steps`` (``schedule/transfers.py``): the actions in order with batches of
transfers between them, each batch one ``batch_isend_irecv`` with one neighbour, in the order the
stream model checked (``schedule/stream_model.py``). Before an action computes, the batches posted
since the last one that receive anything are waited for; a batch of sends only is waited for one
step later (nothing computed next reads it; the device runs its communication in issue order anyway),
so every send's buffer is released within a step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from megatron_het.runtime.boundary import (
    BoundaryLink,
    finish_ops,
    split_receives,
    start_ops,
)
from megatron_het.runtime.split_backward import WeightGradStore
from megatron_het.schedule import Action
from megatron_het.schedule.transfers import Post, Step, forward_only
from megatron_het.train.strategy import ActionHook, BatchFn
from megatron_het.train.timer import EmulationTimer

# forward(chunk, tokens or None, input activation or None) -> activation, or on the last virtual
# stage the micro-batch's share of the global-batch mean loss
ForwardFn = Callable[[int, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


def grad_reduce_trigger(actions: Sequence[Action], *, split_backward: bool = False) -> int | None:
    """Index of the action before which an overlapped gradient synchronizer is armed: the last
    action computing weight gradients (the last B, or with split backward the last W)."""
    triggers = grad_reduce_triggers(actions, split_backward=split_backward)
    return max(triggers) if triggers else None


def grad_reduce_triggers(actions: Sequence[Action], *, split_backward: bool = False) -> dict[int, int]:
    """Action index -> model chunk armed before it: each chunk's last weight-gradient action (its
    last B, or with split backward its last W). Interleaved chunks finish their gradients at
    different points of the schedule; arming each at its own last backward lets its buckets reduce
    while the other chunks still compute."""
    kinds = ("W",) if split_backward and any(a.kind == "W" for a in actions) else ("B", "BW")
    last: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.kind in kinds:
            last[a.chunk] = i
    return {i: c for c, i in last.items()}


def _before_compute(started: list, sending: list) -> list:
    """Wait for the batches just posted that receive (the next action's inputs) and for the sends-only
    batches of the previous step (``sending``): every send is released within a step, on every
    backend (gloo reports a send complete only once waited for). Returns this step's sends-only
    batches."""
    needed, sends = split_receives(started)
    finish_ops(needed + sending)
    return sends


def globalise(actions: Sequence[Action], first_micro_batch: int) -> tuple[Action, ...]:
    """A replica's action list with global micro-batch indices (its micro-batches start at ``first_micro_batch``)."""
    return tuple(Action(kind=a.kind, micro_batch=first_micro_batch + a.micro_batch, chunk=a.chunk) for a in actions)


class ActionExecutor:
    """Runs one rank's action list over global micro-batches, each sent through its pipeline's link."""

    def __init__(self, *, actions: Sequence[Action], links: Mapping[int, BoundaryLink], is_first: bool,
                 is_last: bool, act_shape: tuple[int, int, int], dtype: torch.dtype, micro_batch_size: int,
                 loss_scale: float, split_backward: bool = False, arm: Callable[[], None] | None = None,
                 device: torch.device | None = None, store: WeightGradStore | None = None, num_chunks: int = 1,
                 chunk_links: Mapping[int, BoundaryLink] | None = None, steps: Sequence[Step]) -> None:
        self.actions = tuple(actions)  # this rank's actions, execution order, global micro-batches
        self.links = dict(links)  # global micro-batch -> the link of chunk 0 to its neighbours
        self.num_chunks = num_chunks  # model chunks of this stage (virtual pipeline size)
        self.chunk_links = dict(chunk_links or {})  # chunk c >= 1 -> its link (every micro-batch)
        missing = sorted({a.chunk for a in self.actions if a.chunk} - self.chunk_links.keys())
        if missing or any(a.chunk >= num_chunks for a in self.actions):
            raise ValueError(f"actions: chunks {missing or sorted({a.chunk for a in self.actions})} have no link "
                             f"(this stage has {num_chunks} chunk(s), links for chunks "
                             f"{[0, *sorted(self.chunk_links)]}). Fix: build one link per model chunk")
        self.is_first, self.is_last = is_first, is_last
        self.act_shape, self.dtype = act_shape, dtype  # full [s, b, h] boundary activation
        self.micro_batch_size = micro_batch_size
        self.loss_scale = loss_scale  # a last stage's forward returns loss / loss_scale (global mean share)
        self.split = split_backward and any(a.kind == "W" for a in self.actions)  # see the module docstring
        if self.split and store is None:
            raise ValueError("split_backward: the schedule has W actions but the stage has no WeightGradStore. "
                             "Fix: install_split_linears(model, store) and pass store=")
        self.store = store  # the stage's deferred linear weight gradients (split_backward.py)
        self.arm = arm  # an overlapped synchronizer's arm(chunk): before each chunk's last weight-gradient action
        self.triggers = grad_reduce_triggers(self.actions, split_backward=self.split) if arm is not None else {}
        self.samples: list[int] = []  # sample indices this rank read in the last run (accounting)
        self.device = device  # the accelerator's device: the loss accumulator lives there (None: host)
        self.grad_scale: torch.Tensor | None = None  # fp16 loss scale a last stage multiplies its loss by
        # the actions with their batches of transfers: schedule/transfers.stage_transfer_steps for a
        # plan's schedule, resilience/routed_transfers.routed_transfer_steps for a routed one
        self.steps = tuple(steps)
        if [s for s in self.steps if not isinstance(s, Post)] != list(range(len(self.actions))):
            raise ValueError(f"steps: the {len(self.actions)} actions must each be computed once, in order, between "
                             "the batches. Fix: build them with schedule.transfers.stage_transfer_steps or "
                             "resilience.routed_transfers.routed_transfer_steps for these actions")
        self.forward_steps = forward_only(self.steps, self.actions)  # what an evaluation runs

    def micro_batches(self) -> list[int]:
        """Global micro-batches this rank runs per iteration."""
        return sorted(self.links)

    def _link(self, g: int, chunk: int) -> BoundaryLink:
        return self.chunk_links[chunk] if chunk else self.links[g]

    def _ends(self, chunk: int) -> tuple[bool, bool]:
        """(first virtual stage, last virtual stage) for this stage's ``chunk``."""
        return self.is_first and chunk == 0, self.is_last and chunk == self.num_chunks - 1

    def _msg(self, g: int, chunk: int, *, upstream_of_me: bool) -> int:
        """Tag id of a boundary message: g*V + the chunk on the boundary's upstream side."""
        up = chunk - 1 if upstream_of_me and self.is_first else chunk
        return g * self.num_chunks + up

    def _tokens(self, batch_fn: BatchFn, iteration: int, g: int, chunk: int, *, record: bool) -> torch.Tensor | None:
        first, last = self._ends(chunk)
        if not (first or last):
            return None
        rng = range(g * self.micro_batch_size, (g + 1) * self.micro_batch_size)
        if record:
            self.samples += list(rng)
        return batch_fn(iteration, rng)

    def _post(self, step: Post, inbox: dict[int, torch.Tensor], outbox: dict[int, torch.Tensor]):
        """Start one batch: the results of ``step.sends`` out, buffers for ``step.recvs`` into ``inbox``."""
        ops = []
        for i in step.sends:
            a = self.actions[i]
            downstream = a.kind == "F"
            ops += self._link(a.micro_batch, a.chunk).send_ops(
                outbox.pop(i), downstream=downstream, message=self._msg(a.micro_batch, a.chunk,
                                                                        upstream_of_me=not downstream))
        for i in step.recvs:
            a = self.actions[i]
            downstream = a.kind != "F"
            inbox[i], more = self._link(a.micro_batch, a.chunk).recv_ops(
                self.act_shape, self.dtype, downstream=downstream,
                message=self._msg(a.micro_batch, a.chunk, upstream_of_me=not downstream))
            ops += more
        return start_ops(ops)

    def run(self, *, iteration: int, batch_fn: BatchFn, forward: ForwardFn, params: Sequence[torch.Tensor],
            timer: EmulationTimer, on_action: ActionHook | None = None) -> torch.Tensor:
        """One iteration's actions; returns the local loss sum (last stages: sum of micro-batch means)."""
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}  # (chunk, g) -> (input, output)
        inbox: dict[int, torch.Tensor] = {}  # action index -> its received input (activation or gradient)
        outbox: dict[int, torch.Tensor] = {}  # action index -> its result, until its batch is posted
        # accumulated on the device: no host sync per micro-batch (read once per iteration)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.samples = []
        if self.store is not None:
            self.store.enabled = self.split
        started: list = []  # batches posted since the last action
        sending: list = []  # batches of sends only, in flight
        try:
            for step in self.steps:
                if isinstance(step, Post):
                    started += self._post(step, inbox, outbox)
                    continue
                sending, started = _before_compute(started, sending), []
                index, action = step, self.actions[step]
                if on_action is not None:
                    on_action(index, action)
                g, c = action.micro_batch, action.chunk
                key = (c, g)
                first, last = self._ends(c)
                if action.kind == "F":
                    tokens = self._tokens(batch_fn, iteration, g, c, record=True)
                    inp = None if first else inbox.pop(index).requires_grad_()
                    out = timer.compute(lambda: forward(c, tokens, inp))
                    if last:
                        loss_sum += out.detach().double() * self.loss_scale
                    else:
                        outbox[index] = out.detach()
                    saved[key] = (inp, out)
                elif action.kind in ("B", "BW"):
                    inp, out = saved.pop(key)
                    grad = None if last else inbox.pop(index)
                    if last and self.grad_scale is not None:
                        out = out * self.grad_scale  # the backward of the scaled loss (fp16)
                    if index in self.triggers:  # buckets start reducing as this backward completes them
                        self.arm(self.triggers[index])
                    if self.split and action.kind == "B":
                        with self.store.deferring(key):  # linears keep (input, output grad) for W
                            timer.compute(lambda: torch.autograd.backward(out, grad_tensors=grad))
                    else:
                        timer.compute(lambda: torch.autograd.backward(out, grad_tensors=grad))
                    if not first:
                        outbox[index] = inp.grad
                elif action.kind == "W":
                    if not self.split:
                        continue  # fused into B: autograd computed both gradients together
                    if index in self.triggers:
                        self.arm(self.triggers[index])
                    timer.compute(lambda: self.store.flush(key))
                else:
                    raise ValueError(f"unknown schedule action {action}")
            finish_ops(started + sending)
        except BaseException:
            if self.store is not None:
                self.store.discard()
            raise
        return loss_sum

    @torch.no_grad()
    def evaluate(self, *, iteration: int, batch_fn: BatchFn, forward: ForwardFn) -> torch.Tensor:
        """Forward-only loss sum of one global batch: the plan's forwards in order, their transfers in the
        same batches as in training (``transfers.forward_only``)."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        inbox: dict[int, torch.Tensor] = {}
        outbox: dict[int, torch.Tensor] = {}
        started: list = []
        sending: list = []
        for step in self.forward_steps:
            if isinstance(step, Post):
                started += self._post(step, inbox, outbox)
                continue
            sending, started = _before_compute(started, sending), []
            action = self.actions[step]
            g, c = action.micro_batch, action.chunk
            first, last = self._ends(c)
            tokens = self._tokens(batch_fn, iteration, g, c, record=False)
            out = forward(c, tokens, None if first else inbox.pop(step))
            if last:
                loss_sum += out.double() * self.loss_scale
            else:
                outbox[step] = out
        finish_ops(started + sending)
        return loss_sum
