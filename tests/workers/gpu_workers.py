"""Rank function of the GPU memory test (module-level so torch.multiprocessing.spawn can import it)."""

from __future__ import annotations

import os
import pickle


def pretrain_memory_worker(local_rank: int, world_size: int, argv: list[str], port: int, out_path: str) -> None:
    """pretrain_gpt.py's start-up (as megatron_het.cli.pretrain.main does it) and run, then this rank's
    memory as the accelerator reports it and as torch's allocator does; pickled to ``out_path``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    from megatron_het.cli.pretrain import run
    from megatron_het.platform import detect_accelerator
    from megatron_het.runtime.arguments import parse_args

    args = parse_args(argv)
    acc = detect_accelerator()
    acc.set_device()
    dist.init_process_group(acc.world_backend)
    try:
        result = run(args, acc)
        acc.synchronize()
        reported = acc.memory()
        out = {"losses": [log.lm_loss for log in result.logs], "reported_max_allocated": reported.max_allocated,
               "max_allocated": int(torch.cuda.max_memory_allocated(acc.device)),
               "max_reserved": int(torch.cuda.max_memory_reserved(acc.device)),
               "capacity": int(torch.cuda.get_device_properties(acc.device).total_memory),
               "device": str(acc.device)}
    finally:
        dist.destroy_process_group()
    with open(out_path, "wb") as f:
        pickle.dump(out, f)
