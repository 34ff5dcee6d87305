"""Run megatron-core's training path on CPU tensors over gloo.

megatron-core 0.19.2 assumes CUDA in a few dozen places. On a machine with no accelerator,
``enable_cpu_backend()`` answers each of them, in one of three ways:

1. *Device redirect*: the named megatron module's global ``torch`` is replaced by a proxy that is
   torch except that factory functions map ``device="cuda"`` (or ``torch.cuda.current_device()``)
   to the CPU, and ``torch.cuda`` is a CPU stand-in (no-op synchronize/streams/empty_cache, the CPU
   generator for RNG state). Only the modules listed in ``DEVICE_REDIRECTS`` see it.
2. *Function replacement*: the CUDA RNG state helpers in ``tensor_parallel/random.py``.
3. *Scoped tensor shims*: a few functions call tensor methods (``.cuda()``, ``.type()``) that no
   module proxy can reach; while exactly those functions run, the method is answered for CPU.

Every patch names the upstream file and lines it answers, so it can be dropped when upstream
fixes them. The layer refuses to act when an accelerator is present (GPU runs take the upstream
code unchanged) and is idempotent. It is process-wide by nature (it patches imported modules);
call it once at start-up, before building models.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_het.platform.accelerator import detect_accelerator
from megatron_het.platform.import_guard import install_triton_guard

logger = logging.getLogger(__name__)

# torch factory functions that take a ``device=`` keyword and appear in the patched modules.
_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
    "empty_like", "zeros_like", "ones_like", "full_like", "as_tensor",
)


def _cpu_device(device: Any) -> Any:
    """Map any CUDA device spec to the CPU; leave other values alone."""
    if device is None:
        return None
    if isinstance(device, int):  # torch.cuda.current_device() style index
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CpuStream:
    """Stand-in for torch.cuda.Stream: CPU work is synchronous, so waiting is a no-op."""

    def __init__(self, *_args, **_kwargs):
        pass

    def wait_stream(self, _other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *_args, **_kwargs):
        return _CpuEvent()

    def wait_event(self, _event) -> None:
        pass


class _CpuEvent:
    """Stand-in for the torch.cuda.Event a stream records (MoE's token dispatcher synchronises on it)."""

    def synchronize(self) -> None:
        pass

    def wait(self, *_args) -> None:
        pass

    def query(self) -> bool:
        return True


def _cpu_cuda_namespace() -> types.SimpleNamespace:
    """A ``torch.cuda`` look-alike for CPU processes; unknown names fall through to torch.cuda."""
    real = torch.cuda

    class _Namespace(types.SimpleNamespace):
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    random_ns = types.SimpleNamespace(
        get_rng_state=lambda device=None: torch.get_rng_state(),
        set_rng_state=lambda state, device=None: torch.set_rng_state(state),
    )
    return _Namespace(
        is_available=lambda: False,
        current_device=lambda: torch.device("cpu"),
        device_count=lambda: 0,
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        current_stream=lambda *a, **k: _CpuStream(),
        Stream=_CpuStream,
        stream=lambda _s=None: contextlib.nullcontext(),
        get_rng_state=lambda device=None: torch.get_rng_state(),
        set_rng_state=lambda state, device=None: torch.set_rng_state(state),
        manual_seed=lambda seed: torch.manual_seed(seed),
        random=random_ns,
        OutOfMemoryError=real.OutOfMemoryError,
        amp=real.amp,
        nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
                                   range=lambda *a, **k: contextlib.nullcontext()),
    )


class _CpuTorchProxy(types.ModuleType):
    """torch, with CUDA device requests in factory calls redirected to the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _cpu_cuda_namespace()
        for name in _FACTORIES:
            setattr(self, name, self._redirect(getattr(torch, name)))

    @staticmethod
    def _redirect(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)

        return wrapper

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@dataclass(frozen=True, kw_only=True)
class DeviceRedirect:
    """One megatron module whose global ``torch`` is replaced by the CPU proxy."""

    module: str  # dotted module name under megatron.core
    upstream: str  # the lines in megatron-core 0.19.2 that need it (file:line, what)


DEVICE_REDIRECTS: tuple[DeviceRedirect, ...] = (
    DeviceRedirect(module="megatron.core.tensor_parallel.random",
                   upstream="tensor_parallel/random.py:303-306,490 torch.cuda.get_rng_state/manual_seed"),
    DeviceRedirect(module="megatron.core.pipeline_parallel.p2p_communication",
                   upstream="pipeline_parallel/p2p_communication.py:211-223,334,342 current_device(); 263,419 synchronize()"),
    DeviceRedirect(module="megatron.core.pipeline_parallel.schedules",
                   upstream="pipeline_parallel/schedules.py:749,1121,2292 device=\"cuda\""),
    DeviceRedirect(module="megatron.core.utils",
                   upstream="utils.py:715 GlobalMemoryBuffer current_device(); 1332 device=\"cuda\"; 2189-2278 batch buffers"),
    DeviceRedirect(module="megatron.core.transformer.utils",
                   upstream="transformer/utils.py:39,44 attention masks device=\"cuda\""),
    DeviceRedirect(module="megatron.core.distributed.param_and_grad_buffer",
                   upstream="distributed/param_and_grad_buffer.py:632-814 cuda streams; 1145-1186 buffers"),
    DeviceRedirect(module="megatron.core.distributed.distributed_data_parallel",
                   upstream="distributed/distributed_data_parallel.py:297 torch.cuda.Stream; 649,672 synchronize"),
    DeviceRedirect(module="megatron.core.optimizer.optimizer",
                   upstream="optimizer/optimizer.py:315,690-702,1249 device='cuda'; 1492 current_device()"),
    DeviceRedirect(module="megatron.core.optimizer.grad_scaler",
                   upstream="optimizer/grad_scaler.py:20,111,114,117 device='cuda' (fp16 loss scale tensors)"),
    DeviceRedirect(module="megatron.core.optimizer.clip_grads",
                   upstream="optimizer/clip_grads.py:96,108,112,180,231 device='cuda'"),
    DeviceRedirect(module="megatron.core.optimizer.distrib_optimizer",
                   upstream="optimizer/distrib_optimizer.py:998,1362 current_device()"),
    DeviceRedirect(module="megatron.core.tensor_parallel.layers",
                   upstream="tensor_parallel/layers.py:305,647,708,718,1000,1041 current_device()"),
    DeviceRedirect(module="megatron.core.tensor_parallel.mappings",
                   upstream="tensor_parallel/mappings.py:95,145,152,185,447 gather buffers current_device()"),
    DeviceRedirect(module="megatron.core.pipeline_parallel.bridge_communicator",
                   upstream="pipeline_parallel/bridge_communicator.py:420-597 receive buffers current_device()"),
    DeviceRedirect(module="megatron.core.models.common.embeddings.rotary_pos_embedding",
                   upstream="models/common/embeddings/rotary_pos_embedding.py:162 inv_freq.to(current_device())"),
    DeviceRedirect(module="megatron.core.transformer.moe.token_dispatcher",
                   upstream="transformer/moe/token_dispatcher.py:469 torch.cuda.Stream; 922-946 dtoh stream"),
    DeviceRedirect(module="megatron.core.transformer.moe.router",
                   upstream="transformer/moe/router.py:98-100,184-247 current_device()"),
    DeviceRedirect(module="megatron.core.transformer.moe.moe_utils",
                   upstream="transformer/moe/moe_utils.py aux-loss tracker tensors current_device()"),
    DeviceRedirect(module="megatron.core.transformer.moe.moe_logging",
                   upstream="transformer/moe/moe_logging.py:234 current_device() for the logged losses"),
    DeviceRedirect(module="megatron.core.dist_checkpointing.strategies.filesystem_async",
                   upstream="dist_checkpointing/strategies/filesystem_async.py:248 synchronize() before writing"),
    DeviceRedirect(module="megatron.core.dist_checkpointing.strategies.state_dict_saver",
                   upstream="dist_checkpointing/strategies/state_dict_saver.py:204 device='cuda'; 252 current_device()"),
    DeviceRedirect(module="megatron.core.dist_checkpointing.strategies.async_utils",
                   upstream="dist_checkpointing/strategies/async_utils.py:224,698 current_device(); 273 synchronize()"),
    DeviceRedirect(module="megatron.core.dist_checkpointing.strategies.fully_parallel",
                   upstream="dist_checkpointing/strategies/fully_parallel.py:287,296 synchronize()"),
    DeviceRedirect(module="megatron.core.dist_checkpointing.tensor_aware_state_dict",
                   upstream="dist_checkpointing/tensor_aware_state_dict.py:304 synchronize()"),
)


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_move_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron-core's ``maybe_move_tensor_to_cpu`` converts to numpy only what it copied from a GPU;
    on the host the MoE dispatcher's split sizes stay tensors, which ``all_to_all_single`` refuses."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.detach().numpy()
    return tensor


_ORIGINALS: dict[tuple[str, str], Callable] = {}  # megatron-core functions a FunctionPatch replaced


def _original(module: str, name: str) -> Callable:
    return _ORIGINALS[(module, name)]


_MAPPINGS = "megatron.core.tensor_parallel.mappings"


def _host_gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
    """megatron-core's gather of uneven pieces (the MoE dispatcher's tokens over expert-TP) is a list
    ``all_gather``, which NCCL takes and gloo refuses: on the host each piece is padded to the largest,
    gathered evenly and cut back (the same values)."""
    if output_split_sizes is None or group.size() == 1:
        return _original(_MAPPINGS, "_gather_along_first_dim")(input_, group, output_split_sizes, use_global_buffer)
    import torch.distributed as dist

    sizes = [int(n) for n in output_split_sizes]
    longest = max(sizes)
    padded = input_.new_zeros((longest, *input_.shape[1:]))
    padded[:input_.shape[0]] = input_
    gathered = input_.new_empty((longest * len(sizes), *input_.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded.contiguous(), group=group)
    return torch.cat([gathered[i * longest:i * longest + n] for i, n in enumerate(sizes)])


def _host_reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
    """megatron-core's reduce-scatter of uneven pieces (a list ``reduce_scatter``, which gloo refuses
    unless the pieces are equal): on the host each piece is padded to the largest and reduce-scattered
    evenly, the collective megatron-core's even path calls (gloo runs it as an all-reduce of the padded
    buffer: ProcessGroupGloo, perf/axonn.py; the values are the same)."""
    if input_split_sizes is None or group.size() == 1:
        return _original(_MAPPINGS, "_reduce_scatter_along_first_dim")(input_, group, input_split_sizes,
                                                                         use_global_buffer)
    import torch.distributed as dist

    sizes = [int(n) for n in input_split_sizes]
    longest = max(sizes)
    padded = input_.new_zeros((longest * len(sizes), *input_.shape[1:]))
    first = 0
    for i, n in enumerate(sizes):
        padded[i * longest:i * longest + n] = input_[first:first + n]
        first += n
    out = input_.new_empty((longest, *input_.shape[1:]))
    dist.reduce_scatter_tensor(out, padded, group=group)
    return out[:sizes[group.rank()]].contiguous()


@dataclass(frozen=True, kw_only=True)
class FunctionPatch:
    """Replace ``module.name`` by ``replacement``."""

    module: str
    name: str
    replacement: Callable
    upstream: str  # file:line and what it answers


FUNCTION_PATCHES: tuple[FunctionPatch, ...] = (
    FunctionPatch(module="megatron.core.tensor_parallel.random", name="_get_cuda_rng_state",
                  replacement=_cpu_get_rng_state,
                  upstream="tensor_parallel/random.py:104-132 reads torch.cuda.default_generators"),
    FunctionPatch(module="megatron.core.tensor_parallel.random", name="_set_cuda_rng_state",
                  replacement=_cpu_set_rng_state,
                  upstream="tensor_parallel/random.py:135-174 calls _C._cuda_setRNGState"),
    FunctionPatch(module="megatron.core.transformer.moe.token_dispatcher", name="maybe_move_tensor_to_cpu",
                  replacement=_cpu_move_to_host,
                  upstream="transformer/moe/moe_utils.py:1184 numpy only for CUDA tensors (alltoall split sizes)"),
    FunctionPatch(module=_MAPPINGS, name="_gather_along_first_dim", replacement=_host_gather_along_first_dim,
                  upstream="tensor_parallel/mappings.py:148-153 list all_gather of uneven pieces (gloo refuses)"),
    FunctionPatch(module=_MAPPINGS, name="_reduce_scatter_along_first_dim",
                  replacement=_host_reduce_scatter_along_first_dim,
                  upstream="tensor_parallel/mappings.py:185-196 list reduce_scatter of uneven pieces (gloo refuses)"),
)


@contextlib.contextmanager
def _cpu_tensor_methods():
    """While active: ``t.cuda()`` returns ``t``; ``t.type()`` of a CPU float tensor reads as CUDA.

    Used only around the functions in ``SCOPED_SHIMS``: their tensor-method calls cannot be reached
    by a module proxy. The training loop is single-threaded, so the swap is not observed elsewhere.
    """
    orig_cuda, orig_type = torch.Tensor.cuda, torch.Tensor.type

    def cuda(self, *args, **kwargs):
        return self

    def type_(self, dtype=None, *args, **kwargs):
        if dtype is None and self.device.type == "cpu":
            name = orig_type(self)
            return name.replace("torch.", "torch.cuda.", 1)
        return orig_type(self, dtype, *args, **kwargs)

    torch.Tensor.cuda, torch.Tensor.type = cuda, type_
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.Tensor.type = orig_cuda, orig_type


@dataclass(frozen=True, kw_only=True)
class ScopedShim:
    """Run ``owner.name`` (a function or method) inside ``_cpu_tensor_methods()``."""

    module: str
    owner: str | None  # class name inside the module, or None for a module-level function
    name: str
    upstream: str
    also_bound_in: tuple[str, ...] = ()  # modules that did ``from ... import name`` (module-level only)


SCOPED_SHIMS: tuple[ScopedShim, ...] = (
    ScopedShim(module="megatron.core.models.common.language_module.language_module",
               owner="LanguageModule", name="setup_embeddings_and_output_layer",
               upstream="language_module.py:307 weight.data.cuda() (tied embeddings, PP>1)"),
    ScopedShim(module="megatron.core.optimizer.clip_grads", owner=None,
               name="clip_grad_by_total_norm_fp32",
               upstream="optimizer/clip_grads.py:174 grad.type() == 'torch.cuda.FloatTensor'",
               also_bound_in=("megatron.core.optimizer.optimizer",)),
    ScopedShim(module="megatron.core.optimizer.distrib_optimizer", owner="DistributedOptimizer",
               name="_build_model_and_main_param_groups",
               upstream="optimizer/distrib_optimizer.py:401,466 param.type() == 'torch.cuda.*Tensor'"),
    ScopedShim(module="megatron.core.optimizer.optimizer", owner="Float16OptimizerWithFloat16Params",
               name="__init__",
               upstream="optimizer/optimizer.py:1009,1028 param.type() == 'torch.cuda.*Tensor'"),
)


def _wrap_scoped(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cpu_tensor_methods():
            return fn(*args, **kwargs)

    wrapper.__megatron_het_shim__ = True
    return wrapper


@dataclass(frozen=True, kw_only=True)
class CpuBackendReport:
    """What ``enable_cpu_backend`` did, for the start-up log and tests."""

    active: bool  # False when an accelerator is present (nothing patched)
    redirected_modules: tuple[str, ...]
    replaced_functions: tuple[str, ...]
    scoped_shims: tuple[str, ...]
    triton_guard: bool

    def describe(self) -> str:
        if not self.active:
            return "CPU backend for megatron-core: inactive (accelerator present)"
        return (f"CPU backend for megatron-core: active ({len(self.redirected_modules)} modules redirected, "
                f"{len(self.replaced_functions)} functions replaced, {len(self.scoped_shims)} scoped shims; "
                f"triton guard {'on' if self.triton_guard else 'off'})")


# On GPUs too: dist_checkpointing's saver creates the flags it agrees on over the world group (the
# verify-reuse all-reduce, state_dict_saver.py:204, and the failure broadcast, :252) on the current CUDA
# device, so the world group's device backend carries them: a world-wide NCCL communicator, which ranks
# of two vendors (NCCL beside RCCL) cannot share. On the host they go through the world's gloo.
HOST_FLAG_MODULES = ("megatron.core.dist_checkpointing.strategies.state_dict_saver",)


def keep_checkpoint_flags_on_host() -> None:
    """Redirect ``HOST_FLAG_MODULES``' device requests to the host (whatever the accelerator). Idempotent."""
    proxy = None
    for name in HOST_FLAG_MODULES:
        mod = importlib.import_module(name)
        if not isinstance(getattr(mod, "torch", None), _CpuTorchProxy):
            proxy = proxy or _CpuTorchProxy()
            mod.torch = proxy


def enable_cpu_backend(*, force: bool = False) -> CpuBackendReport:
    """Make megatron-core's training path run on CPU tensors. Idempotent.

    Does nothing (and says so) when a GPU is visible, unless ``force`` (tests only).
    """
    guard = install_triton_guard()
    if detect_accelerator().is_gpu and not force:
        return CpuBackendReport(active=False, redirected_modules=(), replaced_functions=(),
                                scoped_shims=(), triton_guard=guard)
    proxy = _CpuTorchProxy()
    redirected = []
    for r in DEVICE_REDIRECTS:
        mod = importlib.import_module(r.module)
        if not isinstance(getattr(mod, "torch", None), _CpuTorchProxy):
            mod.torch = proxy
        redirected.append(r.module)
    replaced = []
    for p in FUNCTION_PATCHES:
        mod = importlib.import_module(p.module)
        current = getattr(mod, p.name)
        if current is not p.replacement:
            _ORIGINALS.setdefault((p.module, p.name), current)
        setattr(mod, p.name, p.replacement)
        replaced.append(f"{p.module}.{p.name}")
    shimmed = []
    for s in SCOPED_SHIMS:
        mod = importlib.import_module(s.module)
        owner = getattr(mod, s.owner) if s.owner else mod
        fn = getattr(owner, s.name)
        if not getattr(fn, "__megatron_het_shim__", False):
            fn = _wrap_scoped(fn)
            setattr(owner, s.name, fn)
        for other in s.also_bound_in:
            setattr(importlib.import_module(other), s.name, fn)
        shimmed.append(f"{s.module}.{s.owner + '.' if s.owner else ''}{s.name}")
    rng_logger = logging.getLogger("megatron.core.tensor_parallel.random")
    if _SAME_GENERATOR not in rng_logger.filters:
        rng_logger.addFilter(_SAME_GENERATOR)
    report = CpuBackendReport(active=True, redirected_modules=tuple(redirected),
                              replaced_functions=tuple(replaced), scoped_shims=tuple(shimmed),
                              triton_guard=guard)
    logger.info(report.describe())
    return report


def _same_generator(record: logging.LogRecord) -> bool:
    """On the host the tracker's "GPU" generator is the CPU one (``_cpu_get_rng_state``), so every
    attention-dropout fork changes the CPU state megatron-core watches and warns, once per layer and
    micro-batch; the fork restores that state on exit, so nothing is wrong: drop that one warning."""
    return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_SAME_GENERATOR = _same_generator
