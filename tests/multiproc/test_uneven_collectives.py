"""The CPU platform's substitutes for megatron-core's uneven list collectives (gloo refuses uneven
pieces): reduce-scatter and all-gather of uneven, empty and even pieces equal the reference sums and
concatenations, in fp32 and bf16 (the MoE dispatcher calls them under expert-TP)."""

from __future__ import annotations

import torch

from megatron_het.platform.local_launch import run_local

import workers.uneven_collective_workers as workers

CASES = [(3, 5), (0, 4), (0, 0), (2, 2), (6, 1)]


def test_uneven_reduce_scatter_and_gather_equal_the_reference():
    results = run_local(2, workers.uneven_collectives, (CASES,), timeout_s=300)
    for case_index, sizes in enumerate(CASES):
        for d, dtype in enumerate((torch.float32, torch.bfloat16)):
            inputs, pieces = [], []
            for rank in range(2):  # the ranks' inputs, drawn as the workers draw them
                gen = torch.Generator().manual_seed(100 + rank)
                inputs.append(torch.randn(sum(sizes), 3, generator=gen).to(dtype).float())
                pieces.append(torch.randn(sizes[rank], 3, generator=gen).to(dtype).float())
            total, starts = inputs[0] + inputs[1], [0, sizes[0]]
            for rank in range(2):
                got_sizes, got_dtype, scattered, gathered = results[rank][2 * case_index + d]
                assert got_sizes == sizes and got_dtype == str(dtype)
                want = total[starts[rank]:starts[rank] + sizes[rank]]
                tol = 0 if dtype == torch.float32 else 2e-2  # bf16: one rounding of the sum
                assert scattered.shape == want.shape and torch.allclose(scattered, want, atol=tol, rtol=tol)
                assert torch.equal(gathered, torch.cat(pieces))
