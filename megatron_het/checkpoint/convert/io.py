"""Shared plumbing of the adapters: atomic output directories, progress counting, a one-process group."""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from typing import TypeVar

from megatron_het.checkpoint.convert.errors import ConvertError
from megatron_het.platform import HOST_BACKEND
from megatron_het.utils.atomic import default_dir_mode
from megatron_het.utils.progress import ProgressCallback

T = TypeVar("T")


def check_output_dir(path: str) -> str:
    """``path`` made absolute, once it is known to be usable as a new output directory: absent (or an
    empty directory) and under directories only. Checked before any input is read."""
    path = os.path.abspath(path)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConvertError(f"--output {path}: already exists and is not empty. "
                           f"Fix: choose a new output directory or remove this one")
    up = os.path.dirname(path)
    while not os.path.exists(up):
        up = os.path.dirname(up)
    if not os.path.isdir(up):
        raise ConvertError(f"--output {path}: {up} is a file, not a directory. Fix: choose an output directory "
                           f"under a directory")
    return path


@contextlib.contextmanager
def atomic_output_dir(path: str) -> Iterator[str]:
    """Yield a temporary sibling of ``path`` to write into; renamed to ``path`` only on success.

    A failed or interrupted conversion leaves nothing at ``path`` (the temp dir is removed on
    errors; a killed process leaves only a ``.<name>.tmp-*`` sibling).
    """
    path = check_output_dir(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(path)}.tmp-")
    try:
        os.chmod(tmp, default_dir_mode())  # mkdtemp made it 0700; the result is a directory like mkdir's
        yield tmp
        if os.path.isdir(path):
            os.rmdir(path)  # empty (checked above); os.replace cannot replace a directory
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def counted(items: Iterable[T], total: int, progress: ProgressCallback | None) -> Iterator[T]:
    """Yield ``items``, calling ``progress(n, total)`` after the n-th (the library never prints)."""
    for n, item in enumerate(items, 1):
        yield item
        if progress is not None:
            progress(n, total)


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """torch.distributed on one gloo process (dist_checkpointing is collective), unless one is up.

    An existing group must have one rank: conversion reads and writes whole tensors. Also turns on
    the CPU backend for megatron-core (a no-op where a GPU is visible).
    """
    import torch.distributed as dist

    from megatron_het.platform import enable_cpu_backend

    enable_cpu_backend()  # dist_checkpointing synchronises CUDA; on a CPU-only host that is redirected
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ConvertError(f"conversion runs in one process, this one is rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}. Fix: run tools/checkpoint/convert.py without torchrun")
        yield
        return
    with tempfile.TemporaryDirectory(prefix="megatron-het-convert-") as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group(HOST_BACKEND, store=store, rank=0, world_size=1,  # conversion runs on the host
                                timeout=datetime.timedelta(minutes=30))
        try:
            yield
        finally:
            dist.destroy_process_group()
