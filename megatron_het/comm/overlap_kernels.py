"""The optional CUDA/HIP kernel of the chunked collective-GEMM path, and its CPU reference.

``csrc/kernels/chunk_gemm.cu`` computes the GEMM of one all-gathered piece straight into its
place in the rank-major output (no copy); ``chunk_gemm_reference`` is the same contract in
PyTorch, used on the CPU and in tests. ``build_kernels()`` compiles the extension only where a GPU
torch and the matching compiler (nvcc for CUDA, hipcc for ROCm) exist, and otherwise returns why
not. Building is a start-up step (it takes a minute), not an import side effect.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["KERNEL_DIR", "KernelBuild", "build_kernels", "chunk_gemm_reference", "compile_only"]

KERNEL_DIR = Path(__file__).resolve().parents[2] / "csrc" / "kernels"  # sources, next to the package


@dataclass(frozen=True, kw_only=True)
class KernelBuild:
    """Outcome of ``build_kernels``."""

    module: Any  # the loaded extension (has ``chunk_gemm``), or None
    reason: str  # why it was or was not built, for the start-up log


def chunk_gemm_reference(gathered: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *, rows: int,
                         c: int) -> None:
    """CPU twin of ``het_chunk_gemm``: ``out[r*rows + c*cs + i] = gathered[r, i] @ weight^T``.

    ``gathered``: ``[tp, cs, h]`` (piece ``c`` of every rank); ``weight``: ``[n, h]``;
    ``out``: ``[tp*rows, n]``, written in place at piece ``c``'s rows.
    """
    tp, cs, _ = gathered.shape
    if rows % cs or not 0 <= c < rows // cs:
        raise ValueError(f"c: piece {c} of {cs} rows does not fit a shard of {rows} rows "
                         f"(limit {rows // cs - 1 if cs else 0}). Fix: pass 0 <= c < rows / cs")
    out.view(tp, rows // cs, cs, -1)[:, c] = gathered.matmul(weight.t())


def build_kernels(*, verbose: bool = False) -> KernelBuild:
    """Compile and load the extension where possible; never raises for a missing toolkit."""
    if not torch.cuda.is_available():
        return KernelBuild(module=None, reason="no GPU visible to torch: using the PyTorch path")
    hip = torch.version.hip is not None
    compiler = "hipcc" if hip else "nvcc"
    if shutil.which(compiler) is None:
        return KernelBuild(module=None, reason=f"{compiler} not on PATH: using the PyTorch path")
    from torch.utils.cpp_extension import load

    sources = [str(KERNEL_DIR / "chunk_gemm_binding.cpp"), str(KERNEL_DIR / "chunk_gemm.cu")]
    try:  # torch hipifies .cu sources itself on ROCm builds
        module = load(name="megatron_het_chunk_gemm", sources=sources, verbose=verbose)
    except Exception as exc:  # a broken toolkit must not stop training: report and fall back
        return KernelBuild(module=None, reason=f"build failed ({type(exc).__name__}: {exc}); using the PyTorch path")
    return KernelBuild(module=module, reason=f"built with {compiler}")


def compile_only(output: Path, *, nvcc: str | None = None) -> tuple[bool, str]:
    """``nvcc -c`` the kernel source (no GPU needed): (succeeded, compiler output or reason)."""
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        return False, "nvcc not on PATH"
    proc = subprocess.run([nvcc, "-c", str(KERNEL_DIR / "chunk_gemm.cu"), "-o", str(output)],
                          capture_output=True, text=True, timeout=300)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()
