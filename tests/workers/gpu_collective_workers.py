"""Rank functions of tests/gpu/test_gpu_uneven_collectives.py (importable by name for run_local)."""


def nccl_uneven_reduce_scatter_worker(rank, world_size, layouts):
    """comm.uneven's reduce-scatter methods on an NCCL/RCCL group of every rank (one GPU each), per layout:
    each method's slice, and whether the input was left unchanged, on the host."""
    import torch
    import torch.distributed as dist

    from megatron_het.comm.uneven import uneven_reduce_scatter
    from megatron_het.optim.layout import ShardLayout

    torch.cuda.set_device(rank)
    group = dist.new_group(list(range(world_size)), backend="nccl")  # the ROCm build's nccl is RCCL
    out = {"backend": dist.get_backend(group)}
    for tag, sizes in layouts.items():
        layout = ShardLayout(sizes=tuple(sizes))
        full = torch.arange(layout.numel, dtype=torch.float32, device="cuda") + 100 * rank
        for method in ("native", "reduce", "all_reduce"):
            before = full.clone()
            got = uneven_reduce_scatter(full, layout, group=group, method=method)
            out[f"{tag}/{method}"] = (got.device.type, got.cpu().tolist(), bool((full == before).all()))
    torch.cuda.synchronize()
    return out
