"""The chunked TP-overlap linears (comm/overlap.py) sum their chunks' weight gradients in fp32.

Summed in bf16, a running sum of 1.0 swallows each later chunk's 1e-3 (bf16's spacing at 1.0 is
2^-7): dW came out 1.0 where the exact value is 1.007 (1.0078 once rounded to bf16 at the end).
One rank, 8 one-row chunks, so each chunk's partial product is exact and only the sum rounds."""

from __future__ import annotations

import pytest
import torch

from megatron_het.comm.overlap import all_gather_linear, linear_reduce_scatter

from support.one_rank import one_rank_world


@pytest.mark.parametrize("op", [all_gather_linear, linear_reduce_scatter])
def test_chunk_weight_gradients_sum_in_fp32(op):
    x = torch.tensor([1.0] + [1e-3] * 7, dtype=torch.bfloat16).view(8, 1, 1)
    weight = torch.ones(1, 1, dtype=torch.bfloat16, requires_grad=True)
    with one_rank_world():
        import torch.distributed as dist

        y = op(x, weight, group=dist.group.WORLD, chunks=8, overlap=False)
        y.backward(torch.ones_like(y))
    exact = x.double().sum().item()  # 1.007 (the bf16 inputs' own values)
    assert weight.grad.dtype == torch.bfloat16
    assert abs(weight.grad.double().item() - exact) <= 2 ** -9  # half a bf16 spacing at 1.0
