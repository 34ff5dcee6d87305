"""Which device paths the C++ bridge is compiled with (comm/extension.gpu_macros, and setup.py alike).

A CUDA build of torch with the toolkit present compiles the CUDA paths (pinned staging, stream
hand-off) whether or not a GPU is visible: a docker build of the NVIDIA image sees none, and with the
old test (``torch.cuda.is_available()``) its extension was built without them."""

from __future__ import annotations

import torch
import torch.utils.cpp_extension as cpp_extension

from megatron_het.comm.extension import gpu_macros


def test_a_cuda_torch_with_a_toolkit_compiles_the_cuda_paths_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    assert gpu_macros() == ["-DUSE_CUDA"]
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)  # no toolkit: host-only build
    assert gpu_macros() == []
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build of torch
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    assert gpu_macros() == []
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert gpu_macros() == ["-DUSE_ROCM"]


def test_a_failed_gpu_jit_build_falls_back_to_host_only(monkeypatch, tmp_path):
    """A CUDA toolkit the torch cannot build with: the JIT build retries without the device paths."""
    from megatron_het.comm import extension

    calls = []

    def load(**kwargs):
        calls.append(kwargs["extra_cflags"])
        if "-DUSE_CUDA" in kwargs["extra_cflags"]:
            raise RuntimeError("nvcc: unsupported toolkit")
        return "module"

    monkeypatch.setattr(extension, "gpu_macros", lambda: ["-DUSE_CUDA"])
    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setenv(extension.BUILD_DIR_ENV, str(tmp_path))
    assert extension._compile(False) == "module"
    assert calls == [["-O2", "-DUSE_CUDA"], ["-O2"]]
