"""Rank functions for tests/multiproc/test_uneven_collectives.py (no tests inside)."""

from __future__ import annotations


def uneven_collectives(rank: int, world_size: int, cases):
    """The CPU platform's uneven gather / reduce-scatter (megatron-core's MoE dispatcher) on each case's
    split sizes, in fp32 and bf16: each rank's results, to compare with the single-process reference."""
    import torch
    import torch.distributed as dist

    from megatron_het.platform.cpu_backend import _host_gather_along_first_dim, _host_reduce_scatter_along_first_dim

    group = dist.group.WORLD
    out = []
    for sizes in cases:
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(100 + rank)
            whole = torch.randn(sum(sizes), 3, generator=gen).to(dtype)  # this rank's input to reduce-scatter
            mine = torch.randn(sizes[rank], 3, generator=gen).to(dtype)  # this rank's piece to gather
            scattered = _host_reduce_scatter_along_first_dim(whole, group, input_split_sizes=sizes)
            gathered = _host_gather_along_first_dim(mine, group, output_split_sizes=sizes)
            out.append((sizes, str(dtype), scattered.float(), gathered.float()))
    return out
