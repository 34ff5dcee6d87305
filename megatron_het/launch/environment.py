"""Per-vendor environment for the ranks of one island (pure data)."""

from __future__ import annotations

import types
from collections.abc import Mapping

from megatron_het.cluster import AMD, HOST, NVIDIA
from megatron_het.launch.errors import LaunchError

# Settings every Megatron run on that vendor wants. Values stay comma-free: they travel in
# srun --export=ALL,K=V,... lists.
_NVIDIA = (
    ("CUDA_DEVICE_MAX_CONNECTIONS", "1"),  # Megatron's TP/SP overlap needs in-order kernel launch
    ("NCCL_DEBUG", "WARN"),  # surface NCCL init/transport problems without flooding logs
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),  # a failed collective aborts instead of hanging
)
_AMD = (
    ("CUDA_DEVICE_MAX_CONNECTIONS", "1"),  # read by HIP torch too (Megatron checks it on ROCm)
    ("NCCL_DEBUG", "WARN"),  # RCCL reads the NCCL_* names
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),  # same ProcessGroupNCCL code path on ROCm
    ("HSA_FORCE_FINE_GRAIN_PCIE", "1"),  # RCCL peer-to-peer over PCIe/xGMI needs fine-grained memory
)

VENDOR_ENVIRONMENT: Mapping[str, tuple[tuple[str, str], ...]] = types.MappingProxyType(
    {NVIDIA: _NVIDIA, AMD: _AMD, HOST: ()})


def island_environment(vendor: str, *, network_interface: str | None = None) -> tuple[tuple[str, str], ...]:
    """(name, value) pairs exported to every rank of an island of this vendor (() for CPU), plus the
    socket interface of gloo and NCCL/RCCL when the cluster file names one for the island."""
    if vendor not in VENDOR_ENVIRONMENT:
        raise LaunchError(field="vendor", value=vendor, problem="no launch environment for this vendor",
                          fix=f"use one of: {', '.join(VENDOR_ENVIRONMENT)}")
    if network_interface is None:
        return VENDOR_ENVIRONMENT[vendor]
    # gloo (CPU ranks, the het bridge) and NCCL/RCCL bootstrap bind their sockets to this interface
    return (*VENDOR_ENVIRONMENT[vendor], ("GLOO_SOCKET_IFNAME", network_interface),
            ("NCCL_SOCKET_IFNAME", network_interface))
