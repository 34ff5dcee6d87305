"""Run one instance's routed action list on this rank, with split backward (B then W).

``B`` computes only the gradient of the stage input and sends it upstream at once; ``W`` later
computes the weight gradients. With PyTorch autograd, W re-traverses the retained graph (the
stage's backward runs twice over the activations; production zero-bubble code stashes per-layer
inputs and output gradients instead). The gradients are the same sums as the fused backward: both
passes apply the same chain rule to the same tensors (tested in test_resilience_split_backward).
The last stage fuses B and W (its W is a no-op): megatron's vocab-parallel cross-entropy backward
reuses its saved softmax in place, so the loss node cannot be traversed twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatron_het.resilience.routed_schedule import RoutedSchedule
from megatron_het.resilience.routing import InstanceKey, Routing
from megatron_het.runtime.boundary import BoundaryLink, Neighbour


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor | None) -> None:
    """B: accumulate d(out)/d(inp) into ``inp.grad`` only (nothing to do without an input)."""
    if inp is not None:
        torch.autograd.backward(out, grad_tensors=grad, inputs=[inp], retain_graph=True)


def backward_weight(out: torch.Tensor, grad: torch.Tensor | None, params: Sequence[torch.Tensor]) -> None:
    """W: accumulate the weight gradients into ``p.grad`` and free the graph."""
    torch.autograd.backward(out, grad_tensors=grad, inputs=list(params))


ActionHook = Callable[[int, int, object], None]  # (iteration, index, action)


class RoutedExecutor:
    """Executes this rank's instance list of a RoutedSchedule inside HeteroTrainer's step."""

    def __init__(self, *, routing: Routing, schedule: RoutedSchedule, key: InstanceKey, tp_rank: int,
                 on_action: ActionHook | None = None, sequence_parallel: bool = False) -> None:
        self.routing, self.schedule, self.key, self.tp_rank = routing, schedule, key, tp_rank
        self.actions = schedule.actions[key]
        self.on_action = on_action
        self.links: dict[int, BoundaryLink] = {}  # per global micro-batch: neighbours on its pipeline
        mine = routing.instance(key)
        for pipe in routing.pipelines:
            if key not in pipe.hops:
                continue
            s = pipe.hops.index(key)

            def neighbour(hop: InstanceKey) -> Neighbour:
                return Neighbour(ranks=tuple(routing.new_rank(r) for r in routing.instance(hop).ranks))

            link = BoundaryLink(tp_rank=tp_rank, tp=len(mine.ranks),
                                prev=neighbour(pipe.hops[s - 1]) if s > 0 else None,
                                next=neighbour(pipe.hops[s + 1]) if s + 1 < len(pipe.hops) else None,
                                sequence_parallel=sequence_parallel)
            for g in pipe.micro_batches:
                self.links[g] = link
        self.samples: list[int] = []  # sample indices this rank read in the last iteration (accounting)

    def micro_batches(self) -> list[int]:
        """Global micro-batches this instance runs per iteration."""
        return sorted(self.links)

    def run(self, trainer, iteration: int, times) -> torch.Tensor:
        mbs, seq, h = trainer.train.micro_batch_size, trainer.model_spec.seq_length, trainer.model_spec.hidden_size
        act_shape, dtype = (seq, mbs, h), trainer.config.params_dtype
        first, last = trainer.is_first, trainer.is_last
        split = self.schedule.split_backward and not last  # see the module docstring
        params = list(trainer.params.values())
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        out_grads: dict[int, torch.Tensor | None] = {}
        loss_sum = torch.zeros((), dtype=torch.float64)
        self.samples = []
        try:
            for index, action in enumerate(self.actions):
                if self.on_action is not None:
                    self.on_action(iteration, index, action)
                g, link = action.micro_batch, self.links[action.micro_batch]
                if action.kind == "F":
                    tokens = None
                    if first or last:
                        rng = range(g * mbs, (g + 1) * mbs)
                        tokens = trainer.batch_fn(iteration, rng)
                        self.samples += list(rng)
                    inp = None if first else link.recv_forward(act_shape, dtype, g).requires_grad_()
                    out = trainer._timed(times, lambda: trainer._forward(tokens, inp))
                    if last:
                        loss_sum += float(out.detach()) * trainer.total_micro_batches
                    else:
                        link.send_forward(out.detach(), g)
                    saved[g] = (inp, out)
                elif action.kind == "B":
                    inp, out = saved[g]
                    grad = None if last else link.recv_backward(act_shape, out.dtype, g)
                    if split:
                        trainer._timed(times, lambda: backward_input(out, grad, inp))
                        out_grads[g] = grad
                    else:
                        trainer._timed(times, lambda: torch.autograd.backward(out, grad_tensors=grad))
                        saved.pop(g)
                    if not first:
                        link.send_backward(inp.grad, g)
                elif action.kind == "W" and split:
                    inp, out = saved.pop(g)
                    grad = out_grads.pop(g)
                    trainer._timed(times, lambda: backward_weight(out, grad, params))
            for link in set(self.links.values()):
                link.drain()
        finally:
            for link in set(self.links.values()):
                link._pending.clear()  # a failed iteration's sends are abandoned with the group
        return loss_sum
