"""Device types: what one rank sees of a GPU (or a CPU process standing in for one).

Conventions, shared by every entry:
- ``peak_tflops`` is the dense BF16/FP16 tensor rate with FP32 accumulate (what mixed-precision
  training uses); datasheets often headline the 2:4-sparsity number, which is twice this.
- ``memory_gib``: the marketed capacity. HBM and GDDR stacks come in binary sizes, so the
  marketed "80 GB" is 80 GiB of device memory.
- ``memory_bandwidth_gbs``: GB/s (10^9 bytes/s), as in the datasheets.
- ``intra_node_bandwidth_gbps``: Gbit/s per GPU, one direction. Datasheets quote NVLink and
  Infinity Fabric as bidirectional aggregates; we halve them ("NVLink 900 GB/s" -> 450 GB/s
  -> 3600 Gbit/s). PCIe Gen4 x16 is 32 GB/s per direction -> 256 Gbit/s.
- Multi-die packages (MI250X) are listed per die (GCD), because one rank drives one GCD.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_het.cluster.errors import ConfigError
from megatron_het.cluster.fields import as_float, as_name, as_str

__all__ = ["DeviceType", "CATALOG", "VENDORS", "COLLECTIVE_LIBRARIES", "DEFAULT_COLLECTIVE_LIBRARY"]

VENDORS = ("nvidia", "amd", "cpu")
COLLECTIVE_LIBRARIES = ("nccl", "rccl", "gloo")
# The library a vendor's ranks use among themselves; a custom type may choose another.
DEFAULT_COLLECTIVE_LIBRARY = types.MappingProxyType({"nvidia": "nccl", "amd": "rccl", "cpu": "gloo"})


@dataclass(frozen=True, kw_only=True)
class DeviceType:
    """One catalog entry; figures are per rank (per GPU, or per GCD for multi-die parts)."""

    name: str  # catalog key, e.g. "A100-80GB"
    vendor: str  # "nvidia" | "amd" | "cpu"
    collective_library: str  # "nccl" | "rccl" | "gloo": what ranks of this type talk through
    peak_tflops: float  # dense bf16/fp16 TFLOP/s (no sparsity)
    memory_gib: float  # device memory, GiB
    memory_bandwidth_gbs: float  # HBM/GDDR bandwidth, GB/s
    intra_node_bandwidth_gbps: float  # per-GPU intra-node link (NVLink/xGMI/PCIe), Gbit/s, one direction
    source: str  # datasheet reference for the figures

    def __post_init__(self) -> None:
        as_name(self.name, "name", example="'A100-80GB'")
        if self.vendor not in VENDORS:
            raise ConfigError("unknown vendor", field="vendor", value=self.vendor,
                              fix=f"use one of: {', '.join(VENDORS)}")
        if self.collective_library not in COLLECTIVE_LIBRARIES:
            raise ConfigError("unknown collective library", field="collective_library",
                              value=self.collective_library,
                              fix=f"use one of: {', '.join(COLLECTIVE_LIBRARIES)}")
        for field in ("peak_tflops", "memory_gib", "memory_bandwidth_gbs", "intra_node_bandwidth_gbps"):
            object.__setattr__(self, field, as_float(getattr(self, field), field))
        as_str(self.source, "source", example="'<vendor> <product> Datasheet'")


def _entries() -> tuple[DeviceType, ...]:
    return (
        DeviceType(
            name="V100-32GB", vendor="nvidia", collective_library="nccl",
            peak_tflops=125.0, memory_gib=32.0, memory_bandwidth_gbs=900.0,
            intra_node_bandwidth_gbps=1200.0,
            source="NVIDIA Tesla V100 GPU Datasheet (SXM2 32GB): 125 TFLOPS tensor (fp16), "
                   "32 GB HBM2, 900 GB/s, NVLink 300 GB/s bidirectional -> 150 GB/s per direction",
        ),
        DeviceType(
            name="A100-40GB", vendor="nvidia", collective_library="nccl",
            peak_tflops=312.0, memory_gib=40.0, memory_bandwidth_gbs=1555.0,
            intra_node_bandwidth_gbps=2400.0,
            source="NVIDIA A100 Tensor Core GPU Datasheet (SXM4 40GB): BF16 312 TFLOPS dense "
                   "(624 sparse), 40 GB HBM2, 1,555 GB/s, NVLink 600 GB/s bidirectional",
        ),
        DeviceType(
            name="A100-80GB", vendor="nvidia", collective_library="nccl",
            peak_tflops=312.0, memory_gib=80.0, memory_bandwidth_gbs=2039.0,
            intra_node_bandwidth_gbps=2400.0,
            source="NVIDIA A100 Tensor Core GPU Datasheet (SXM4 80GB): BF16 312 TFLOPS dense "
                   "(624 sparse), 80 GB HBM2e, 2,039 GB/s, NVLink 600 GB/s bidirectional",
        ),
        DeviceType(
            name="H100-SXM", vendor="nvidia", collective_library="nccl",
            peak_tflops=989.4, memory_gib=80.0, memory_bandwidth_gbs=3350.0,
            intra_node_bandwidth_gbps=3600.0,
            source="NVIDIA H100 Tensor Core GPU Datasheet (SXM5): BF16 1,979 TFLOPS sparse "
                   "-> 989.4 dense, 80 GB HBM3, 3.35 TB/s, NVLink 900 GB/s bidirectional",
        ),
        DeviceType(
            name="H200", vendor="nvidia", collective_library="nccl",
            peak_tflops=989.4, memory_gib=141.0, memory_bandwidth_gbs=4800.0,
            intra_node_bandwidth_gbps=3600.0,
            source="NVIDIA H200 Tensor Core GPU Datasheet (H200 SXM): BF16 1,979 TFLOPS sparse "
                   "-> 989.4 dense, 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s bidirectional",
        ),
        DeviceType(
            name="L40S", vendor="nvidia", collective_library="nccl",
            peak_tflops=362.05, memory_gib=48.0, memory_bandwidth_gbs=864.0,
            intra_node_bandwidth_gbps=256.0,
            source="NVIDIA L40S GPU Datasheet: BF16 362.05 TFLOPS dense (733 sparse), 48 GB GDDR6, "
                   "864 GB/s, PCIe Gen4 x16 (no NVLink)",
        ),
        DeviceType(
            name="RTX-4090", vendor="nvidia", collective_library="nccl",
            peak_tflops=165.2, memory_gib=24.0, memory_bandwidth_gbs=1008.0,
            intra_node_bandwidth_gbps=256.0,
            source="NVIDIA Ada GPU Architecture whitepaper, Appendix (GeForce RTX 4090): BF16 tensor "
                   "with FP32 accumulate 165.2 TFLOPS dense, 24 GB GDDR6X, 1,008 GB/s, PCIe Gen4 x16",
        ),
        DeviceType(
            name="RTX-3080", vendor="nvidia", collective_library="nccl",
            peak_tflops=59.5, memory_gib=10.0, memory_bandwidth_gbs=760.0,
            intra_node_bandwidth_gbps=256.0,
            source="NVIDIA Ampere GA102 GPU Architecture whitepaper (GeForce RTX 3080): BF16 tensor "
                   "with FP32 accumulate 59.5 TFLOPS dense, 10 GB GDDR6X, 760 GB/s, PCIe Gen4 x16",
        ),
        DeviceType(
            name="MI250X", vendor="amd", collective_library="rccl",
            peak_tflops=191.5, memory_gib=64.0, memory_bandwidth_gbs=1638.4,
            intra_node_bandwidth_gbps=1600.0,
            source="AMD Instinct MI250X Accelerator Datasheet: 383 TFLOPS FP16/BF16, 128 GB HBM2e, "
                   "3.2768 TB/s per 2-GCD package; PER GCD here (one rank): 191.5 TFLOPS, 64 GB, "
                   "1,638.4 GB/s, 4 of 8 Infinity Fabric links x 50 GB/s per direction",
        ),
        DeviceType(
            name="MI300X", vendor="amd", collective_library="rccl",
            peak_tflops=1307.4, memory_gib=192.0, memory_bandwidth_gbs=5300.0,
            intra_node_bandwidth_gbps=3584.0,
            source="AMD Instinct MI300X Accelerator Datasheet: BF16 1,307.4 TFLOPS dense "
                   "(2,614.9 sparse), 192 GB HBM3, 5.3 TB/s, 7 Infinity Fabric links x 128 GB/s "
                   "bidirectional -> 448 GB/s per direction",
        ),
        DeviceType(
            name="CPU", vendor="cpu", collective_library="gloo",
            peak_tflops=1.0, memory_gib=16.0, memory_bandwidth_gbs=50.0,
            intra_node_bandwidth_gbps=100.0,
            source="Nominal figures, not a datasheet: one CPU process standing in for a GPU in "
                   "emulation (a few cores of a server CPU, shared memory transport)",
        ),
    )


# Read-only: users add or override types in their cluster file, never by mutating this.
CATALOG: Mapping[str, DeviceType] = types.MappingProxyType({d.name: d for d in _entries()})
