"""Collective-matmul overlap for sequence-parallel tensor-parallel linear layers.

Two autograd functions, each the communication + GEMM of one Megatron layer kind with sequence
parallelism (Korthikanti et al. 2022), cut into ``chunks`` pieces along the sequence dim so the
collective of one piece runs (async, on the backend's own threads) while another piece's GEMM
computes (Wang et al. 2023, "Overlap communication with dependent computation via decomposition";
AxoNN's overlapped all-reduce/reduce-scatter, Singh et al. 2024):

* ``all_gather_linear`` (column-parallel): ``Y = all_gather_seq(X) @ W^T``.
  forward: all-gather piece i+1 || GEMM piece i.
  backward: reduce-scatter of ``dX`` piece i || ``dX`` GEMM of piece i+1 and ``dW`` of piece i.
* ``linear_reduce_scatter`` (row-parallel): ``Y = reduce_scatter_seq(X @ W^T)``.
  forward: reduce-scatter piece i || GEMM piece i+1.
  backward: all-gather of ``dY`` piece i+1 || ``dX``/``dW`` GEMMs of piece i.

Piece ``c`` of every rank's shard is communicated together, so each collective is an ordinary
equal-size ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (both work on gloo with
``async_op=True`` in torch 2.13; checked in tests/test_overlap_layers.py). Results equal the
unchunked layer up to floating-point summation order: the reduction dim of every GEMM is not
split, only the row dim, so forward outputs and input gradients are bitwise the per-row GEMMs;
weight gradients sum the pieces' partial products (a different order than one GEMM).

Tensor layout is Megatron's ``[sequence, batch..., hidden]``; the sequence dim (0) is the one
sharded. With ``chunks=1`` the functions are Megatron's non-overlapped path (one collective, one
GEMM), which the benchmark uses as its baseline. The gathered input of the column layer is kept
for the weight gradient (Megatron re-gathers it in backward instead: less memory, more traffic).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_het.comm.overlap_chunks import effective_chunks

__all__ = ["all_gather_linear", "linear_reduce_scatter"]


def _group_size(group: Any) -> int:
    return dist.get_world_size(group=group)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool):
    """``out`` is ``[tp, rows, ...]``; gloo wants the dim-0 concatenation ``[tp*rows, ...]`` (a view)."""
    return dist.all_gather_into_tensor(out.view(-1, *out.shape[2:]), inp.contiguous(), group=group,
                                       async_op=async_op)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool):
    """``inp`` is ``[tp, rows, ...]``, flattened to ``[tp*rows, ...]`` for the backend."""
    inp = inp.contiguous()
    return dist.reduce_scatter_tensor(out, inp.view(-1, *inp.shape[2:]), group=group, async_op=async_op)


def _wait(work: Any) -> None:
    if work is not None:  # blocking collectives return None
        work.wait()


def _mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """``a @ b_t`` over the last dim of ``a`` (any leading dims)."""
    return torch.matmul(a, b_t)


def _wgrad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``sum over rows of dy^T x``: [out, in] from [..., out] and [..., in]."""
    return dy.reshape(-1, dy.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class _AllGatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group: Any, chunks: int,
                overlap: bool) -> torch.Tensor:
        tp = _group_size(group)
        x = x.contiguous()
        rows, rest, h = x.shape[0], x.shape[1:-1], x.shape[-1]
        k = effective_chunks(rows, chunks)
        cs = rows // k
        pieces = x.view(k, cs, *rest, h)
        gathered = x.new_empty((k, tp, cs, *rest, h))  # gathered[c][r] = piece c of rank r's shard
        # Returned as is (not a view: megatron-core's cross entropy edits logits in place).
        result = x.new_empty((tp * rows, *rest, weight.shape[0]))
        out = result.view(tp, k, cs, *rest, weight.shape[0])  # rank-major = global sequence order
        works = [None] * k
        works[0] = _all_gather(gathered[0], pieces[0], group, overlap)
        for c in range(k):
            if c + 1 < k:  # start the next piece's gather before this piece's GEMM
                works[c + 1] = _all_gather(gathered[c + 1], pieces[c + 1], group, overlap)
            _wait(works[c])
            out[:, c] = _mm(gathered[c], weight.t())
        ctx.save_for_backward(gathered, weight)
        ctx.group, ctx.k, ctx.overlap = group, k, overlap
        return result

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gathered, weight = ctx.saved_tensors
        k, tp = ctx.k, gathered.shape[1]
        cs, rest, h = gathered.shape[2], gathered.shape[3:-1], gathered.shape[-1]
        dy = dy.contiguous().view(tp, k, cs, *rest, weight.shape[0])
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dy.new_empty((k, cs, *rest, h)) if need_dx else None
        dw = _wgrad_accumulator(weight) if need_dw else None
        works = []
        for c in range(k):
            if need_dx:  # dX piece c of every rank, then reduce-scatter it to its owner (async)
                works.append(_reduce_scatter(dx[c], _mm(dy[:, c], weight), ctx.group, ctx.overlap))
            if need_dw:  # overlaps the reduce-scatter just started
                dw += _wgrad(dy[:, c], gathered[c])
        for w in works:
            _wait(w)
        dx = dx.view(k * cs, *rest, h) if need_dx else None
        return dx, None if dw is None else dw.to(weight.dtype), None, None, None


def _wgrad_accumulator(weight: torch.Tensor) -> torch.Tensor:
    """Zeros to sum the chunks' weight gradients in: at least fp32 (bf16/fp16 sums of k partial
    products lose bits at every add; megatron-core accumulates weight gradients in fp32 too)."""
    return torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32))


class _LinearReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group: Any, chunks: int,
                overlap: bool) -> torch.Tensor:
        tp = _group_size(group)
        x = x.contiguous()
        full, rest, kin = x.shape[0], x.shape[1:-1], x.shape[-1]
        if full % tp:
            raise ValueError(f"input.shape[0]: the sequence length {full} must be a multiple of the "
                             f"tensor-parallel size {tp}. Fix: pad the sequence to a multiple of {tp}")
        rows = full // tp
        k = effective_chunks(rows, chunks)
        cs = rows // k
        xv = x.view(tp, k, cs, *rest, kin)
        result = x.new_empty((rows, *rest, weight.shape[0]))  # returned as is, not a view
        out = result.view(k, cs, *rest, weight.shape[0])
        works = []
        for c in range(k):  # GEMM of piece c+1 runs while piece c reduce-scatters
            works.append(_reduce_scatter(out[c], _mm(xv[:, c], weight.t()), group, overlap))
        for w in works:
            _wait(w)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.k, ctx.overlap = group, k, overlap
        return result

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        k, tp = ctx.k, _group_size(ctx.group)
        rows, rest, n = dy.shape[0], dy.shape[1:-1], dy.shape[-1]
        cs = rows // k
        dy = dy.contiguous().view(k, cs, *rest, n)
        xv = x.view(tp, k, cs, *rest, x.shape[-1])
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gathered = dy.new_empty((k, tp, cs, *rest, n))
        dx = x.new_empty((tp, k, cs, *rest, x.shape[-1])) if need_dx else None
        dw = _wgrad_accumulator(weight) if need_dw else None
        works = [None] * k
        works[0] = _all_gather(gathered[0], dy[0], ctx.group, ctx.overlap)
        for c in range(k):
            if c + 1 < k:
                works[c + 1] = _all_gather(gathered[c + 1], dy[c + 1], ctx.group, ctx.overlap)
            _wait(works[c])
            if need_dx:
                dx[:, c] = _mm(gathered[c], weight)
            if need_dw:
                dw += _wgrad(gathered[c], xv[:, c])
        dx = dx.view(tp * rows, *rest, x.shape[-1]) if need_dx else None
        return dx, None if dw is None else dw.to(weight.dtype), None, None, None


def all_gather_linear(x: torch.Tensor, weight: torch.Tensor, *, group: Any = None, chunks: int = 4,
                      overlap: bool = True) -> torch.Tensor:
    """Column-parallel GEMM with sequence parallelism: ``all_gather(x, dim 0) @ weight^T``.

    ``x``: this rank's sequence shard ``[s/tp, ..., in]``; ``weight``: this rank's ``[out/tp, in]``
    slice. Returns ``[s, ..., out/tp]``. No bias (add it outside, as Megatron does).
    """
    return _AllGatherLinear.apply(x, weight, group, chunks, overlap)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, *, group: Any = None, chunks: int = 4,
                          overlap: bool = True) -> torch.Tensor:
    """Row-parallel GEMM with sequence parallelism: ``reduce_scatter(x @ weight^T, dim 0)``.

    ``x``: ``[s, ..., in/tp]``; ``weight``: this rank's ``[out, in/tp]`` slice. Returns this rank's
    sequence shard ``[s/tp, ..., out]`` of the summed output. No bias.
    """
    return _LinearReduceScatter.apply(x, weight, group, chunks, overlap)
