"""Split backward (zero-bubble B/W) for megatron-core's tensor-parallel linears, without re-running the graph.

A schedule's ``B`` action runs the backward once through the stage's graph; every linear of the
stage (megatron's ColumnParallelLinear / RowParallelLinear, the output layer included) computes its
input gradient there and, instead of its weight GEMM, keeps the (input, output-gradient) pair in a
``WeightGradStore`` under the action's (chunk, micro-batch) key. The ``W`` action of that key then
computes ``dW = dY^T X`` (and ``db = sum dY``) for those pairs and accumulates them through autograd
(so gradient hooks, e.g. overlapped reduction, fire as for a fused backward). Element-wise
parameters (norms, embeddings, biases added outside the GEMM) are tiny and keep their gradient in
``B``. As in the ZB paper and torch.distributed.pipelining: what W computes is the linears' weight
gradients, and nothing of the forward or the input-gradient path runs twice.

Ours, not megatron-core's: its deferred weight gradients exist only with Transformer Engine
(``delay_wgrad_compute``) or for the output layer alone (``defer_embedding_wgrad_compute``); the
local linears compute dW inside the same autograd node as dX.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Hashable, Iterator

import torch
import torch.distributed as dist

import megatron_het.platform  # noqa: F401  (triton import guard before the lazy megatron.core import)

__all__ = ["WeightGradStore", "deferred_linear", "install_split_linears", "unsplit_linears"]


class WeightGradStore:
    """Deferred linear weight gradients of one stage, per schedule key (chunk, micro-batch)."""

    def __init__(self) -> None:
        self.enabled = False  # True while the stage runs a split (B/W) schedule: linears go through this store
        self.key: Hashable | None = None  # key of the backward running now (None: compute dW at once)
        # key -> [(weight, bias or None, input [n, in], output gradient [n, out])]
        self.pending: dict[Hashable, list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]]] = {}
        self.flushed = 0  # linears whose weight gradient W actions computed (all time): proof the split ran

    @contextlib.contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """Linears' weight gradients of the backward run inside go to ``key`` instead of ``.grad``."""
        self.key = key
        self.pending.setdefault(key, [])
        try:
            yield
        finally:
            self.key = None

    def flush(self, key: Hashable) -> int:
        """W: compute and accumulate the weight gradients kept under ``key``; returns how many linears."""
        entries = self.pending.pop(key, [])
        grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> (param, summed gradient)

        def add(p: torch.Tensor, g: torch.Tensor) -> None:
            if id(p) in grads:
                grads[id(p)] = (p, grads[id(p)][1] + g)
            else:
                grads[id(p)] = (p, g)

        for weight, bias, inp, grad in entries:
            add(weight, grad.t().matmul(inp))
            if bias is not None:
                add(bias, grad.sum(dim=0))
        if grads:
            params, values = zip(*grads.values())
            torch.autograd.backward(list(params), grad_tensors=list(values))  # accumulate: hooks fire
        self.flushed += len(entries)
        return len(entries)

    def discard(self) -> None:
        """Forget every deferred gradient (a failed iteration)."""
        self.pending.clear()
        self.key = None


class _DeferredWeightLinear(torch.autograd.Function):
    """``y = x W^T + b`` with no autograd edge to W and b: backward returns dX and hands (x, dY) to the
    store (W computes dW, db later); outside ``store.deferring`` they are accumulated at once."""

    @staticmethod
    def forward(ctx, inp, weight_data, bias_data, params, store, allreduce_dgrad, tp_group):  # noqa: ANN001
        ctx.save_for_backward(inp, weight_data)
        ctx.weight, ctx.bias = params  # the parameters, in a tuple: not inputs, so no edge and no hook in B
        ctx.store, ctx.allreduce_dgrad, ctx.tp_group = store, allreduce_dgrad, tp_group
        out = torch.matmul(inp, weight_data.t())
        return out + bias_data if bias_data is not None else out

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001
        inp, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        handle = None
        if ctx.allreduce_dgrad:
            handle = dist.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        store, key = ctx.store, ctx.store.key
        store.pending.setdefault(key, []).append(
            (ctx.weight, ctx.bias, inp.reshape(-1, inp.shape[-1]), grad_output.reshape(-1, grad_output.shape[-1])))
        if key is None:  # a backward outside B (e.g. a test's plain .backward()): weight gradients now
            store.flush(None)
        if handle is not None:
            handle.wait()
        return grad_input, None, None, None, None, None, None


def deferred_linear(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: WeightGradStore, *,
                    allreduce_dgrad: bool = False, tp_group=None) -> torch.Tensor:  # noqa: ANN001
    """``inp @ weight^T + bias`` whose weight/bias gradients go to ``store`` when a backward runs under
    ``store.deferring(key)`` (else into ``.grad`` as usual); ``allreduce_dgrad``: all-reduce dX over ``tp_group``."""
    return _DeferredWeightLinear.apply(inp, weight.detach(), None if bias is None else bias.detach(), (weight, bias),
                                       store, allreduce_dgrad, tp_group)


def _split_forward_impl(original, store: WeightGradStore, input, weight, bias=None,  # noqa: A002, ANN001
                        gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False,
                        grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None, gtp_remat_size=1,
                        **kwargs):
    """megatron's ``_forward_impl`` signature; the store's path when the stage runs a split schedule."""
    plain = (not store.enabled or not weight.requires_grad or gradient_accumulation_fusion
             or grad_output_buffer is not None or (gtp_remat_size or 1) > 1 or kwargs)
    if plain:
        return original(input=input, weight=weight, bias=bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                        allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                        grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit,
                        tp_group=tp_group, gtp_remat_size=gtp_remat_size, **kwargs)
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    if sequence_parallel:  # the gather's own backward reduce-scatters dX, as megatron's fused node does
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True,  # noqa: A001
                                                     group=tp_group)
    return deferred_linear(input, weight, bias, store, allreduce_dgrad=allreduce_dgrad, tp_group=tp_group)


def install_split_linears(model: torch.nn.Module, store: WeightGradStore) -> list[str]:
    """Route every megatron local linear of ``model`` through ``store`` (active while ``store.enabled``).

    Linears whose forward was replaced by the TP-overlap path keep their fused backward (their dW
    stays in B). Returns the names of the linears routed."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    done = []
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or hasattr(module, "_het_overlap"):
            continue
        module._forward_impl = functools.partial(_split_forward_impl, module._forward_impl, store)
        done.append(name)
    return done


def unsplit_linears(model: torch.nn.Module, routed: list[str]) -> list[str]:
    """Linears of ``model`` (a module whose class name ends in ``Linear`` with a 2-D weight) that
    ``install_split_linears`` did not route: transformer-engine's (``TE*Linear``; its own deferral,
    ``delay_wgrad_compute``, is not wired here) and TP-overlap ones. Their weight gradients stay in B,
    so a split-backward schedule defers less W than the plan was priced with."""
    done = set(routed)
    out = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (type(module).__name__.endswith("Linear") and isinstance(weight, torch.Tensor) and weight.dim() == 2
                and name not in done):
            out.append(name)
    return out
