"""Chunked collective-GEMM kernel: the CPU reference's layout, the build fallback, nvcc compile."""

import shutil

import pytest
import torch

from megatron_het.comm.overlap_kernels import KERNEL_DIR, build_kernels, chunk_gemm_reference, compile_only


def test_reference_assembles_the_rank_major_output():
    tp, rows, k, h, n = 3, 6, 3, 5, 4
    g = torch.Generator().manual_seed(0)
    shards = torch.randn(tp, rows, h, generator=g, dtype=torch.float64)  # every rank's sequence shard
    w = torch.randn(n, h, generator=g, dtype=torch.float64)
    out = torch.full((tp * rows, n), float("nan"), dtype=torch.float64)
    cs = rows // k
    for c in range(k):  # piece c of every rank, as all_gather_into_tensor delivers it
        chunk_gemm_reference(shards[:, c * cs:(c + 1) * cs], w, out, rows=rows, c=c)
    expect = shards.reshape(tp * rows, h) @ w.t()
    assert torch.allclose(out, expect, rtol=0, atol=1e-12)


def test_reference_rejects_bad_piece():
    out = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"c: piece 2 of 1 rows does not fit a shard of 2 rows \(limit 1\)"):
        chunk_gemm_reference(torch.zeros(2, 1, 3), torch.zeros(2, 3), out, rows=2, c=2)


def test_build_falls_back_with_a_reason_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("GPU present: the build is exercised for real there")
    build = build_kernels()
    assert build.module is None
    assert build.reason == "no GPU visible to torch: using the PyTorch path"


def test_sources_exist_and_are_hipify_friendly():
    cu = (KERNEL_DIR / "chunk_gemm.cu").read_text()
    assert "het_chunk_gemm_f32" in cu and "__global__" in cu
    includes = [line.strip() for line in cu.splitlines() if line.startswith("#include")]
    assert includes == ["#include <cuda_runtime.h>"]  # the runtime API only: hipify maps all of it
    code = "\n".join(line.split("//")[0] for line in cu.splitlines())
    for cuda_only in ("__shfl", "asm(", "cooperative_groups"):  # nothing hipify cannot map
        assert cuda_only not in code
    assert (KERNEL_DIR / "chunk_gemm_binding.cpp").exists()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_nvcc_compiles_the_kernel(tmp_path):
    ok, log = compile_only(tmp_path / "chunk_gemm.o")
    assert ok, log
    assert (tmp_path / "chunk_gemm.o").stat().st_size > 1000
