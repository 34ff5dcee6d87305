"""dist_checkpointing's saver agrees on two flags over the world group; on GPUs it creates them on the
CUDA device, so the world's NCCL would carry them: a world-wide communicator, impossible between NVIDIA
and AMD ranks. ``keep_checkpoint_flags_on_host`` (called by every checkpoint save) moves them to the host
whatever the accelerator (enable_cpu_backend does the same on CPU-only hosts, but not on GPUs)."""

from __future__ import annotations

import importlib

import torch

from megatron_het.platform import enable_cpu_backend, keep_checkpoint_flags_on_host
from megatron_het.platform.cpu_backend import HOST_FLAG_MODULES


def test_the_savers_flags_are_created_on_the_host_even_where_a_gpu_is_seen(monkeypatch):
    enable_cpu_backend()  # megatron-core importable on this host
    mod = importlib.import_module(HOST_FLAG_MODULES[0])
    monkeypatch.setattr(mod, "torch", torch)  # as on a GPU host: enable_cpu_backend left it alone
    keep_checkpoint_flags_on_host()
    flag = mod.torch.tensor([1], dtype=torch.int, device="cuda")  # state_dict_saver.py:204
    failed = mod.torch.tensor([0], dtype=torch.int, device=mod.torch.cuda.current_device())  # :252
    assert flag.device.type == failed.device.type == "cpu"
    assert mod.torch.distributed is torch.distributed  # collectives are torch's own
    again = mod.torch
    keep_checkpoint_flags_on_host()
    assert mod.torch is again  # idempotent
