"""Which accelerator this process has: CUDA (NVIDIA), ROCm/HIP (AMD) or none.

torch exposes ROCm through the ``torch.cuda`` API, so the vendor is told apart by
``torch.version.hip``. The answer decides the collective backend a rank uses inside its island
(NCCL, RCCL through torch's ``nccl`` backend on ROCm, or gloo) and whether the CPU backend for
megatron-core must be enabled.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """What this process can compute on."""

    kind: str  # "cuda" (NVIDIA), "rocm" (AMD, HIP behind torch.cuda) or "cpu"
    device_count: int  # visible devices of that kind; 0 for "cpu"
    torch_backend: str  # torch.distributed backend for collectives inside an island: "nccl" or "gloo"
    device_name: str  # torch's name for device 0, or "cpu"

    @property
    def is_gpu(self) -> bool:
        return self.kind != "cpu"


def detect_accelerator() -> Accelerator:
    """Inspect torch for a usable GPU; never raises."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        return Accelerator(
            kind=kind,
            device_count=torch.cuda.device_count(),
            torch_backend="nccl",  # torch maps "nccl" to RCCL on ROCm builds
            device_name=torch.cuda.get_device_name(0),
        )
    return Accelerator(kind="cpu", device_count=0, torch_backend="gloo", device_name="cpu")


@dataclass(frozen=True, kw_only=True)
class OptionalAccelerators:
    """Optional GPU libraries megatron-core can use; absent ones fall back to local code."""

    transformer_engine: bool  # TE layer spec and fused kernels; else megatron-core's local spec
    apex: bool  # apex fused optimizers/layernorm; else torch's
    triton: bool  # triton kernels (MoE paged stash); else megatron_het's import guard

    def describe(self) -> str:
        te = "transformer-engine layer spec" if self.transformer_engine else "megatron-core local layer spec"
        opt = "apex fused Adam" if self.apex else "torch Adam"
        return f"{te}; {opt}; triton {'present' if self.triton else 'absent (import guard active)'}"


def detect_optional_accelerators(accelerator: Accelerator | None = None) -> OptionalAccelerators:
    """transformer-engine and apex only count on a GPU: their CPU wheels do nothing useful."""
    acc = accelerator or detect_accelerator()

    def importable(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    return OptionalAccelerators(
        transformer_engine=acc.is_gpu and importable("transformer_engine"),
        apex=acc.is_gpu and importable("apex"),
        triton=importable("triton"),
    )
