"""comm.uneven's default reduce-scatter ("native") on NCCL/RCCL (docs/gpu.md; skipped without GPUs).

On a GPU group "native" is one collective: ``reduce_scatter_tensor`` for equal shards, the list form
``dist.reduce_scatter`` for uneven ones (torch runs it as one coalesced group of reduces, root i for
slice i). The distributed optimizer and the sharded strategy use it by default; on CPU (gloo) it runs
the per-owner reduces, so only this tier runs the NCCL path. Checked on integer-valued fp32 sums
(exact in any order): every method's slice, on the GPU, with the input left unchanged."""

from __future__ import annotations

import pytest
import torch

from megatron_het.platform.local_launch import run_local

from support.gpu_run import gpu_count, need_gpus

pytestmark = pytest.mark.gpu


def test_native_reduce_scatter_on_nccl_matches_the_sums():
    need_gpus(2)
    world = min(gpu_count(), 4)
    layouts = {"uneven": [3 + r for r in range(world)], "equal": [4] * world,
               "empty": [0] + [2 + r for r in range(1, world)]}
    from workers.gpu_collective_workers import nccl_uneven_reduce_scatter_worker

    per_rank = run_local(world, nccl_uneven_reduce_scatter_worker, (layouts,))
    for rank, out in enumerate(per_rank):
        assert out["backend"] == "nccl"
        for tag, sizes in layouts.items():
            lo = sum(sizes[:rank])
            summed = sum(torch.arange(sum(sizes), dtype=torch.float32) + 100 * r for r in range(world))
            for method in ("native", "reduce", "all_reduce"):
                device, values, unchanged = out[f"{tag}/{method}"]
                assert device == "cuda" and unchanged, (rank, tag, method)
                assert values == summed[lo:lo + sizes[rank]].tolist(), (rank, tag, method)
