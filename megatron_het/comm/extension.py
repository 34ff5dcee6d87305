"""Find the C++ `het` backend: prebuilt by setup.py, else JIT-compiled, else report why not.

The choice is reported by ``het_backend_info()`` so a run can say which implementation carried
its cross-island traffic. Nothing is cached here: a loaded extension lives in ``sys.modules``.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

EXTENSION_NAME = "megatron_het_het_C"  # module name of both the setup.py and the JIT build
PREBUILT_MODULE = "megatron_het._het_C"  # where setup.py puts the compiled extension
_REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCES = (_REPO_ROOT / "csrc" / "het_backend.cpp",)
BUILD_DIR_ENV = "MEGATRON_HET_BUILD_DIR"  # overrides the JIT cache directory
NO_JIT_ENV = "MEGATRON_HET_NO_JIT"  # "1": never compile at run time (use prebuilt or Python)


@dataclass(frozen=True, kw_only=True)
class HetBackendInfo:
    """Which implementation `new_hierarchical_group(implementation="auto")` will use, and why."""

    implementation: str  # "cpp" or "python"
    reason: str  # one sentence: how the C++ extension was found, or why it was not
    gpu_build: str  # "cuda", "rocm" or "none": which device paths the extension was compiled with


def gpu_macros() -> list[str]:
    """`-D` flags that switch on the device paths of csrc/ for the torch build at hand."""
    if getattr(torch.version, "hip", None):
        return ["-DUSE_ROCM"]
    if torch.version.cuda:  # a CUDA build of torch: compile the device paths whether or not a GPU is seen
        from torch.utils.cpp_extension import CUDA_HOME  # (e.g. a docker build); they need the toolkit

        if CUDA_HOME is not None:
            return ["-DUSE_CUDA"]
    return []


def jit_build_dir() -> Path:
    """Cache directory for the JIT build: reused while the sources are unchanged."""
    override = os.environ.get(BUILD_DIR_ENV)
    return Path(override) if override else _REPO_ROOT / "build" / "het_ext"


def _compile(verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    build_dir = jit_build_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    macros = gpu_macros()

    def load(macros: list[str]) -> ModuleType:
        # with_cuda: CUDA (or, on ROCm builds, HIP) include and library paths for the GPU branches; torch
        # infers it from .cu sources only, and csrc/ is all .cpp
        return cpp_extension.load(name=EXTENSION_NAME, sources=[str(s) for s in SOURCES],
                                  extra_cflags=["-O2", *macros], build_directory=str(build_dir),
                                  with_cuda=bool(macros), verbose=verbose)

    if macros:
        try:
            return load(macros)
        except Exception as exc:  # e.g. a CUDA toolkit this torch cannot build with: the host-only build serves
            logger.warning("GPU build of the C++ het backend failed (%s); building it host-only", exc)
    return load([])


def load_extension(*, allow_jit: bool = True, verbose: bool = False) -> tuple[ModuleType | None, str]:
    """The extension module (or None) and a sentence saying how it was obtained or why not."""
    if EXTENSION_NAME in sys.modules:
        return sys.modules[EXTENSION_NAME], "C++ extension already loaded in this process"
    try:
        return importlib.import_module(PREBUILT_MODULE), "prebuilt C++ extension (setup.py build)"
    except ImportError:
        pass
    if not allow_jit or os.environ.get(NO_JIT_ENV) == "1":
        return None, f"no prebuilt C++ extension and JIT disabled ({NO_JIT_ENV}=1 or allow_jit=False)"
    if not all(s.exists() for s in SOURCES):
        return None, f"C++ sources not found at {SOURCES[0].parent} (installed without csrc/)"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return None, f"no C++ compiler ({compiler!r} not on PATH)"
    try:
        return _compile(verbose), f"JIT-compiled C++ extension (cache: {jit_build_dir()})"
    except Exception as exc:  # a broken toolchain must not stop training: fall back, say why
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"JIT compile of csrc/ failed: {first}"


def het_backend_info(*, allow_jit: bool = True) -> HetBackendInfo:
    """Which implementation "auto" picks on this machine, and why (may compile csrc/ once)."""
    module, reason = load_extension(allow_jit=allow_jit)
    if module is None:
        return HetBackendInfo(implementation="python", reason=reason, gpu_build="none")
    return HetBackendInfo(implementation="cpp", reason=reason, gpu_build=str(module.GPU_BUILD))
