"""Platform layer: accelerator detection and the CPU backend for megatron-core.

Importing this package installs the import guards (see ``import_guard.py``) so that any later
``import megatron.core.models.gpt`` works on machines without triton, and ``megatron.training``
on Python 3.11; everything else is an explicit call.
"""

from megatron_het.platform.accelerator import (
    HOST_BACKEND,
    HOST_DEVICE,
    HOST_LIBRARY,
    TORCH_BACKENDS,
    Accelerator,
    MemoryStats,
    OptionalAccelerators,
    backend_devices,
    detect_accelerator,
    detect_optional_accelerators,
    island_group_backend,
)
from megatron_het.platform.cpu_backend import CpuBackendReport, enable_cpu_backend, keep_checkpoint_flags_on_host
from megatron_het.platform.import_guard import install_triton_guard, install_typing_override

install_triton_guard()
install_typing_override()

__all__ = [
    "HOST_BACKEND",
    "HOST_DEVICE",
    "HOST_LIBRARY",
    "TORCH_BACKENDS",
    "Accelerator",
    "MemoryStats",
    "CpuBackendReport",
    "OptionalAccelerators",
    "backend_devices",
    "detect_accelerator",
    "island_group_backend",
    "detect_optional_accelerators",
    "enable_cpu_backend",
    "keep_checkpoint_flags_on_host",
    "install_triton_guard",
    "install_typing_override",
]
