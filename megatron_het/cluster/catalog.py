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
- ``tflops``: dense rate per precision (no sparsity), from the same datasheet: "fp32" is the
  non-tensor (CUDA core / vector) FP32 rate, "tf32" the tensor-core rate for FP32 matmuls (NVIDIA
  Ampere and later; AMD MI300X's TF32 matrix rate; MI250X has an FP32 *matrix* rate, listed as its
  "tf32"), "fp16"/"bf16" the 16-bit tensor rates with FP32 accumulate, "fp8" where the part has it.
  A precision the part lacks is absent. ``peak_tflops`` stays the 16-bit dense rate.
- ``compute_units``: SMs (NVIDIA) or CUs per die (AMD) a GEMM's thread-block tiles are spread
  over; the compute model in perf/compute.py uses it for wave quantisation.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_het.cluster.errors import ConfigError
from megatron_het.cluster.fields import as_float, as_name, as_str

__all__ = ["AMD", "CATALOG", "COLLECTIVE_LIBRARIES", "DEFAULT_COLLECTIVE_LIBRARY", "GLOO", "HOST", "NCCL", "NVIDIA",
           "PRECISIONS", "RCCL", "VENDORS", "DeviceType"]

# Training precisions, as Megatron's flags name them: fp32 (default, no flag), tf32 (fp32 storage,
# tensor-core matmuls: torch.backends.cuda.matmul.allow_tf32), --fp16, --bf16, --fp8-format
# (Transformer Engine: fp8 GEMMs, bf16 everywhere else).
PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp8")

# Vendor and collective-library names as cluster files write them (data, never handed to torch: the
# accelerator in platform/ picks devices and backends). Named once here so other packages compare
# against these constants, or ask DeviceType.is_host, instead of repeating the strings.
NVIDIA, AMD, HOST = "nvidia", "amd", "cpu"
NCCL, RCCL, GLOO = "nccl", "rccl", "gloo"
VENDORS = (NVIDIA, AMD, HOST)
COLLECTIVE_LIBRARIES = (NCCL, RCCL, GLOO)
# The library a vendor's ranks use among themselves; a custom type may choose another.
DEFAULT_COLLECTIVE_LIBRARY = types.MappingProxyType({NVIDIA: NCCL, AMD: RCCL, HOST: GLOO})


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
    # Dense TFLOP/s per precision (see the module docstring); None: 16-bit only, at peak_tflops.
    # (stored as sorted (precision, rate) pairs so the type stays hashable and copyable)
    tflops: Mapping[str, float] | tuple[tuple[str, float], ...] | None = None
    compute_units: int | None = None  # SMs / CUs per rank; None: no wave quantisation

    @property
    def is_host(self) -> bool:
        """A host processor standing in for a GPU (emulation): no GPU kernels, no fused attention."""
        return self.vendor == HOST

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
        rates = {"fp16": self.peak_tflops, "bf16": self.peak_tflops}
        given = self.tflops
        if isinstance(given, tuple):
            given = dict(given)
        if given is not None:
            if not isinstance(given, Mapping):
                raise ConfigError("must be a mapping of precision to TFLOP/s", field="tflops", value=self.tflops,
                                  fix="write e.g. {fp32: 19.5, tf32: 156, bf16: 312}")
            for k, v in given.items():
                if k not in PRECISIONS:
                    raise ConfigError("unknown precision", field=f"tflops.{k}", value=k,
                                      fix=f"use one of: {', '.join(PRECISIONS)}")
                rates[k] = as_float(v, f"tflops.{k}")
        # peak_tflops is the 16-bit rate and wins (a cluster file overriding it keeps this consistent)
        rates["fp16"] = rates["bf16"] = self.peak_tflops
        object.__setattr__(self, "tflops", tuple(sorted(rates.items())))
        if self.compute_units is not None and (isinstance(self.compute_units, bool)
                                               or not isinstance(self.compute_units, int) or self.compute_units < 1):
            raise ConfigError("must be an integer >= 1", field="compute_units", value=self.compute_units,
                              fix="give the SM (NVIDIA) or CU (AMD) count per rank, e.g. 108")

    def rate_tflops(self, precision: str) -> float:
        """Dense TFLOP/s of this device's matmuls at ``precision``.

        fp32 matmuls run at the FP32 (non-tensor) rate; tf32 at the TF32 tensor rate, or the FP32
        rate where the part has none; fp8 at the FP8 rate, or the 16-bit rate where the part has
        none (Transformer Engine then falls back to 16-bit GEMMs). A part without a 16-bit rate for
        the requested one (V100 has no bf16) runs it at its fp16 rate. Without per-precision
        figures (a user-defined type giving only peak_tflops), fp32/tf32 take 1/16 and 1/2 of it
        (A100's ratios), so a fp32 run is never priced like a bf16 one.
        """
        if precision not in PRECISIONS:
            raise ConfigError("unknown precision", field="precision", value=precision,
                              fix=f"use one of: {', '.join(PRECISIONS)}")
        rates = dict(self.tflops)
        sixteen = rates.get("bf16", rates.get("fp16", self.peak_tflops))
        if precision == "fp32":
            return rates.get("fp32", sixteen / 16)
        if precision == "tf32":
            return rates.get("tf32", rates.get("fp32", sixteen / 2))
        if precision == "fp8":
            return rates.get("fp8", sixteen)
        return rates.get(precision, sixteen)


def _entries() -> tuple[DeviceType, ...]:
    return (
        DeviceType(
            name="V100-32GB", vendor=NVIDIA, collective_library=NCCL,
            peak_tflops=125.0, memory_gib=32.0, memory_bandwidth_gbs=900.0,
            intra_node_bandwidth_gbps=1200.0,
            source="NVIDIA Tesla V100 GPU Datasheet (SXM2 32GB): 125 TFLOPS tensor (fp16), "
                   "32 GB HBM2, 900 GB/s, NVLink 300 GB/s bidirectional -> 150 GB/s per direction; "
                   "FP32 15.7 TFLOPS, no TF32/BF16 tensor cores; 80 SMs (Volta whitepaper)",
            tflops={"fp32": 15.7, "fp16": 125.0}, compute_units=80,
        ),
        DeviceType(
            name="A100-40GB", vendor=NVIDIA, collective_library=NCCL,
            peak_tflops=312.0, memory_gib=40.0, memory_bandwidth_gbs=1555.0,
            intra_node_bandwidth_gbps=2400.0,
            source="NVIDIA A100 Tensor Core GPU Datasheet (SXM4 40GB): BF16 312 TFLOPS dense "
                   "(624 sparse), 40 GB HBM2, 1,555 GB/s, NVLink 600 GB/s bidirectional; FP32 19.5, "
                   "TF32 156 dense (312 sparse); 108 SMs (Ampere GA100 whitepaper)",
            tflops={"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}, compute_units=108,
        ),
        DeviceType(
            name="A100-80GB", vendor=NVIDIA, collective_library=NCCL,
            peak_tflops=312.0, memory_gib=80.0, memory_bandwidth_gbs=2039.0,
            intra_node_bandwidth_gbps=2400.0,
            source="NVIDIA A100 Tensor Core GPU Datasheet (SXM4 80GB): BF16 312 TFLOPS dense "
                   "(624 sparse), 80 GB HBM2e, 2,039 GB/s, NVLink 600 GB/s bidirectional; FP32 19.5, "
                   "TF32 156 dense (312 sparse); 108 SMs (Ampere GA100 whitepaper)",
            tflops={"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}, compute_units=108,
        ),
        DeviceType(
            name="H100-SXM", vendor=NVIDIA, collective_library=NCCL,
            peak_tflops=989.4, memory_gib=80.0, memory_bandwidth_gbs=3350.0,
            intra_node_bandwidth_gbps=3600.0,
            source="NVIDIA H100 Tensor Core GPU Datasheet (SXM5): BF16 1,979 TFLOPS sparse "
                   "-> 989.4 dense, 80 GB HBM3, 3.35 TB/s, NVLink 900 GB/s bidirectional; FP32 67, "
                   "TF32 989 sparse -> 494.7 dense, FP8 3,958 sparse -> 1,978.9 dense; 132 SMs",
            tflops={"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4, "fp8": 1978.9},
            compute_units=132,
        ),
        DeviceType(
            name="H200", vendor=NVIDIA, collective_library=NCCL,
            peak_tflops=989.4, memory_gib=141.0, memory_bandwidth_gbs=4800.0,
            intra_node_bandwidth_gbps=3600.0,
            source="NVIDIA H200 Tensor Core GPU Datasheet (H200 SXM): BF16 1,979 TFLOPS sparse "
                   "-> 989.4 dense, 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s bidirectional; FP32 67, "
                   "TF32 494.7 dense, FP8 1,978.9 dense; 132 SMs (the H100 SXM die)",
            tflops={"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4, "fp8": 1978.9},
            compute_units=132,
        ),
        DeviceType(
            name="L40S", vendor=NVIDIA, collective_library=NCCL,
            peak_tflops=362.05, memory_gib=48.0, memory_bandwidth_gbs=864.0,
            intra_node_bandwidth_gbps=256.0,
            source="NVIDIA L40S GPU Datasheet: BF16 362.05 TFLOPS dense (733 sparse), 48 GB GDDR6, "
                   "864 GB/s, PCIe Gen4 x16 (no NVLink); FP32 91.6, TF32 183 dense, FP8 733 dense; "
                   "142 SMs",
            tflops={"fp32": 91.6, "tf32": 183.0, "fp16": 362.05, "bf16": 362.05, "fp8": 733.0},
            compute_units=142,
        ),
        DeviceType(
            name="RTX-4090", vendor=NVIDIA, collective_library=NCCL,
            peak_tflops=165.2, memory_gib=24.0, memory_bandwidth_gbs=1008.0,
            intra_node_bandwidth_gbps=256.0,
            source="NVIDIA Ada GPU Architecture whitepaper, Appendix (GeForce RTX 4090): BF16 tensor "
                   "with FP32 accumulate 165.2 TFLOPS dense, 24 GB GDDR6X, 1,008 GB/s, PCIe Gen4 x16; "
                   "FP32 82.6, TF32 82.6 dense, FP8 with FP32 accumulate 330.3 dense; 128 SMs",
            tflops={"fp32": 82.6, "tf32": 82.6, "fp16": 165.2, "bf16": 165.2, "fp8": 330.3},
            compute_units=128,
        ),
        DeviceType(
            name="RTX-3080", vendor=NVIDIA, collective_library=NCCL,
            peak_tflops=59.5, memory_gib=10.0, memory_bandwidth_gbs=760.0,
            intra_node_bandwidth_gbps=256.0,
            source="NVIDIA Ampere GA102 GPU Architecture whitepaper (GeForce RTX 3080): BF16 tensor "
                   "with FP32 accumulate 59.5 TFLOPS dense, 10 GB GDDR6X, 760 GB/s, PCIe Gen4 x16; "
                   "FP32 29.8, TF32 29.8 dense; 68 SMs",
            tflops={"fp32": 29.8, "tf32": 29.8, "fp16": 59.5, "bf16": 59.5}, compute_units=68,
        ),
        DeviceType(
            name="MI250X", vendor=AMD, collective_library=RCCL,
            peak_tflops=191.5, memory_gib=64.0, memory_bandwidth_gbs=1638.4,
            intra_node_bandwidth_gbps=1600.0,
            source="AMD Instinct MI250X Accelerator Datasheet: 383 TFLOPS FP16/BF16, 128 GB HBM2e, "
                   "3.2768 TB/s per 2-GCD package; PER GCD here (one rank): 191.5 TFLOPS, 64 GB, "
                   "1,638.4 GB/s, 4 of 8 Infinity Fabric links x 50 GB/s per direction; FP32 vector "
                   "47.9 and FP32 matrix 95.7 per package (no TF32, no FP8) -> 23.95 / 47.85 per GCD; "
                   "220 CUs per package -> 110 per GCD",
            tflops={"fp32": 23.95, "tf32": 47.85, "fp16": 191.5, "bf16": 191.5}, compute_units=110,
        ),
        DeviceType(
            name="MI300X", vendor=AMD, collective_library=RCCL,
            peak_tflops=1307.4, memory_gib=192.0, memory_bandwidth_gbs=5300.0,
            intra_node_bandwidth_gbps=3584.0,
            source="AMD Instinct MI300X Accelerator Datasheet: BF16 1,307.4 TFLOPS dense "
                   "(2,614.9 sparse), 192 GB HBM3, 5.3 TB/s, 7 Infinity Fabric links x 128 GB/s "
                   "bidirectional -> 448 GB/s per direction; FP32 163.4, TF32 653.7, FP8 2,614.9 "
                   "dense; 304 CUs",
            tflops={"fp32": 163.4, "tf32": 653.7, "fp16": 1307.4, "bf16": 1307.4, "fp8": 2614.9},
            compute_units=304,
        ),
        DeviceType(
            name="CPU", vendor=HOST, collective_library=GLOO,
            peak_tflops=1.0, memory_gib=16.0, memory_bandwidth_gbs=50.0,
            intra_node_bandwidth_gbps=100.0,
            source="Nominal figures, not a datasheet: one CPU process standing in for a GPU in "
                   "emulation (a few cores of a server CPU, shared memory transport); every precision "
                   "at the same nominal rate (a measured profile replaces them: tools/profile_host.py)",
            tflops={"fp32": 1.0, "tf32": 1.0, "fp16": 1.0, "bf16": 1.0},
        ),
    )


# Read-only: users add or override types in their cluster file, never by mutating this.
CATALOG: Mapping[str, DeviceType] = types.MappingProxyType({d.name: d for d in _entries()})
