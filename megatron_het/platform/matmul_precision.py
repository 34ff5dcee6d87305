"""A tf32 plan runs TF32 matmuls: the plan's precision decides torch's fp32 matmul setting.

The planner prices a ``tf32`` plan at tensor-core rates (``perf/compute.py``) while its tensors stay
fp32 (``plan.types.TRAINS_IN``); torch runs fp32 matmuls in IEEE fp32 unless told, so without this a
tf32 plan trained several times slower than priced. Only the new API (``fp32_precision``) is used:
torch refuses to read the legacy ``allow_tf32`` once the new one was set. Other plans leave torch's
defaults alone (fp32 matmuls in IEEE fp32, as priced); the start-up line says which one runs.
"""

from __future__ import annotations

import torch

__all__ = ["apply_fp32_matmul", "fp32_matmul_setting"]


def fp32_matmul_setting(plan_precision: str | None) -> str | None:
    """torch's ``fp32_precision`` a plan of ``plan_precision`` asks for; None: torch's default."""
    return "tf32" if plan_precision == "tf32" else None


def apply_fp32_matmul(plan_precision: str | None, *, is_gpu: bool) -> str:
    """Set the fp32 matmul precision for a plan of ``plan_precision``; the start-up line."""
    setting = fp32_matmul_setting(plan_precision)
    if setting is None:
        return "fp32 matmuls: torch's default (IEEE fp32 unless the environment overrides it)"
    torch.backends.cuda.matmul.fp32_precision = setting  # cuBLAS / hipBLAS(Lt) matmuls
    torch.backends.cudnn.conv.fp32_precision = setting  # cuDNN / MIOpen (the model has no convolutions)
    where = "tensor cores where the device has them" if is_gpu else "the host has none: IEEE fp32 here"
    return f"fp32 matmuls: TF32 (plan precision tf32; torch.backends.cuda.matmul.fp32_precision = 'tf32'; {where})"
