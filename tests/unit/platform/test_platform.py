"""The CPU platform layer: detection, the triton guard, and each device redirect."""

from __future__ import annotations

import importlib
import inspect
import re
import sys

import pytest
import torch

from megatron_het.platform import detect_accelerator, detect_optional_accelerators, enable_cpu_backend
from megatron_het.platform.cpu_backend import DEVICE_REDIRECTS, FUNCTION_PATCHES, SCOPED_SHIMS
from megatron_het.platform.import_guard import PAGED_STASH_OPS


def test_detects_cpu_here():
    acc = detect_accelerator()
    assert acc.kind == "cpu" and acc.torch_backend == "gloo" and not acc.is_gpu
    opt = detect_optional_accelerators(acc)
    assert not opt.transformer_engine and not opt.apex  # never on a CPU, even if importable
    assert "local layer spec" in opt.describe()


def test_triton_guard_lets_gpt_model_import_and_fails_clearly_if_used():
    pytest.importorskip("megatron.core")
    from megatron.core.models.gpt import GPTModel  # noqa: F401  (would raise ModuleNotFoundError: triton)

    stub = sys.modules[PAGED_STASH_OPS]
    if importlib.util.find_spec("triton") is None:
        assert stub.__megatron_het_guard__
        with pytest.raises(RuntimeError, match="needs triton and a GPU"):
            stub.paged_stash_copy_kernel[(1,)]()


def test_enable_is_idempotent_and_redirects_cuda_factories():
    first = enable_cpu_backend()
    second = enable_cpu_backend()
    assert first.active and second.active
    assert first.redirected_modules == second.redirected_modules
    from megatron.core.optimizer import clip_grads
    from megatron.core.transformer import utils as tutils

    # upstream transformer/utils.py:39 builds the causal mask with device="cuda"
    mask = tutils.get_default_causal_mask(4)
    assert mask.device.type == "cpu" and mask.shape == (4, 4) and bool(mask[0, 1]) and not bool(mask[1, 0])
    # the proxy still is torch for everything else
    assert clip_grads.torch.float32 is torch.float32
    assert clip_grads.torch.zeros(2, device="cuda").device.type == "cpu"
    assert clip_grads.torch.cuda.current_device() == torch.device("cpu")
    # a shimmed function is wrapped exactly once even after two calls
    fn = importlib.import_module("megatron.core.optimizer.optimizer").clip_grad_by_total_norm_fp32
    assert fn.__megatron_het_shim__ and not getattr(fn.__wrapped__, "__megatron_het_shim__", False)


def test_rng_tracker_forks_on_cpu_without_disturbing_default_stream():
    enable_cpu_backend()
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(3)
    after = torch.rand(3)
    assert not torch.equal(inside, expected)  # the fork used the model-parallel stream
    assert torch.equal(after, expected)  # and restored the default one


@pytest.mark.parametrize("patch", DEVICE_REDIRECTS, ids=lambda p: p.module.rsplit(".", 1)[-1])
def test_each_redirect_still_answers_an_upstream_cuda_use(patch):
    """When upstream stops using CUDA in a module, this fails: drop that redirect."""
    src = inspect.getsource(importlib.import_module(patch.module))
    assert re.search(r"cuda", src), f"{patch.module} no longer mentions cuda; remove its redirect"
    assert re.match(r"^[\w/]+\.py", patch.upstream), "each patch names its upstream file"


@pytest.mark.parametrize("patch", FUNCTION_PATCHES + SCOPED_SHIMS, ids=lambda p: p.name)
def test_each_patched_function_exists_upstream(patch):
    mod = importlib.import_module(patch.module)
    owner = getattr(mod, patch.owner) if getattr(patch, "owner", None) else mod
    fn = getattr(owner, patch.name)
    src = inspect.getsource(getattr(fn, "__wrapped__", fn)) if not hasattr(patch, "replacement") else ""
    if src:
        assert "cuda" in src, f"{patch.name} no longer uses CUDA; remove its shim"


def test_the_host_drops_megatrons_same_generator_warning(caplog):
    """On CPU the RNG tracker's "GPU" generator is the CPU one: megatron-core's warning that the CPU state
    changed inside a fork would fire for every attention dropout; only that warning is dropped."""
    import logging

    from megatron_het.platform import enable_cpu_backend

    enable_cpu_backend()
    log = logging.getLogger("megatron.core.tensor_parallel.random")
    with caplog.at_level(logging.WARNING):
        log.warning("CPU RNG state changed within GPU RNG context")
        log.warning("another warning")
    assert [r.getMessage() for r in caplog.records if r.name == log.name] == ["another warning"]
