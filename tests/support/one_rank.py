"""A one-process gloo world for unit tests that build real process groups (trainers, group builders)."""

from __future__ import annotations

import contextlib
import datetime

import pytest
import torch.distributed as dist

from megatron_het.platform.local_launch import free_port


@contextlib.contextmanager
def one_rank_world(timeout: datetime.timedelta | None = None):
    """Rank 0 of a world of 1 on gloo for the duration; skips the test if a world already exists."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            **({} if timeout is None else {"timeout": timeout}))
    try:
        yield
    finally:
        dist.destroy_process_group()
