"""Make megatron-core importable without triton.

megatron-core 0.19.2 ``transformer/moe/ops/paged_stash.py`` line 4 does ``import triton``
unguarded, and ``transformer/moe/paged_stash.py`` line 12 imports it; ``models/gpt/gpt_model.py``
line 32 and ``pipeline_parallel/schedules.py`` line 27 import that in turn. So on a machine without
triton (1 GB, GPU-only) neither GPTModel nor the pipeline schedules import.

Choice: when triton is absent, register a stand-in for exactly that one megatron module (not a fake
``triton``, which would fool megatron's many ``try: import triton`` guards into taking GPU paths).
The stand-in exports the same names; calling a kernel raises a clear error, since the MoE paged
stash is a GPU-only feature. With triton installed the real module is used and this does nothing.
Drop this file once upstream guards the import.

The same wheel's ``megatron/training/`` (Megatron-LM's argument parser, which pretrain_gpt.py uses)
does ``from typing import override`` (Python 3.12) in ``training/models/{gpt,hybrid}.py``, so on
Python 3.11 it does not import. ``install_typing_override`` registers typing_extensions' backport
of that decorator (the same function: it only sets ``__override__``) when typing lacks it.
"""

from __future__ import annotations

import importlib.util
import sys
import types

PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


def _unavailable(*_args, **_kwargs):
    raise RuntimeError(
        "The MoE paged stash needs triton and a GPU; it is not available on this machine "
        "(megatron_het installed an import guard for megatron-core's triton kernels). "
        "Install triton on a GPU machine, or leave moe paged stash disabled."
    )


class _UnavailableKernel:
    """Stands in for a ``@triton.jit`` kernel; ``kernel[grid](...)`` raises."""

    def __getitem__(self, _grid):
        return _unavailable

    __call__ = _unavailable


def install_triton_guard() -> bool:
    """Register the stand-in when triton is missing. Idempotent; returns True if it is active."""
    if importlib.util.find_spec("triton") is not None:
        return False
    existing = sys.modules.get(PAGED_STASH_OPS)
    if existing is not None:
        return getattr(existing, "__megatron_het_guard__", False)
    stub = types.ModuleType(PAGED_STASH_OPS)
    stub.__doc__ = "megatron_het stand-in: triton is not installed (see megatron_het/platform/import_guard.py)"
    stub.__megatron_het_guard__ = True
    stub.GLOBAL_BLOCK_SIZE = 1024  # same constant as upstream, used only for buffer sizing
    stub.paged_stash_copy_kernel = _UnavailableKernel()
    stub.paged_stash_pop_kernel = _UnavailableKernel()
    stub.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[PAGED_STASH_OPS] = stub
    return True


def install_typing_override() -> bool:
    """``typing.override`` from typing_extensions on Python < 3.12. Idempotent; True if installed."""
    import typing

    if hasattr(typing, "override"):
        return False
    from typing_extensions import override

    typing.override = override
    return True
