"""Kernel-level figures of the compute model (perf/compute.py), kept apart so that profiles
(perf/profile.py) and the generated calibrated defaults can use them without importing the model."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_het.cluster import ConfigError

__all__ = ["PRECISION_CLASSES", "TILE_SHAPES", "ComputeParams", "precision_class"]

PRECISION_CLASSES = ("fp32", "tf32", "16bit", "fp8")


def precision_class(precision: str) -> str:
    """fp16 and bf16 share tensor cores and figures: "16bit"; others are their own class."""
    if precision in ("fp16", "bf16"):
        return "16bit"
    if precision in ("fp32", "tf32", "fp8"):
        return precision
    raise ConfigError("unknown precision", field="precision", value=precision,
                      fix="use one of: fp32, tf32, fp16, bf16, fp8")


# (tile_m, tile_n, relative efficiency of the tile shape): the large tile is what cuBLAS/hipBLASLt pick
# for big training GEMMs; smaller ones trade arithmetic intensity for fewer idle SMs.
TILE_SHAPES = ((256, 128, 1.0), (128, 128, 0.92), (128, 64, 0.8), (64, 64, 0.6))


@dataclass(frozen=True, kw_only=True)
class ComputeParams:
    """Kernel-level figures of one device type at one precision class."""

    gemm_efficiency: float  # fraction of the precision's dense rate a large, well-shaped GEMM reaches
    attention_efficiency: float  # fused attention: fraction of the 16-bit rate on its (causal) FLOPs
    kernel_overhead_us: float  # fixed cost of every kernel: launch, ramp-up, tail
    memory_efficiency: float = 0.8  # fraction of memory bandwidth element-wise kernels reach
    k_half: float = 64.0  # reduction depth at which a tile's main loop runs at half speed
    elementwise_kernels: int = 10  # non-GEMM kernels of one layer's forward (norms, residuals, activation, ...)
    # fp8: the norms before the QKV and fc1 GEMMs write their output in fp8 themselves (Transformer
    # Engine's LayerNormLinear, megatron-core's TE spec), so those two inputs need only a transpose,
    # not a cast; False when every GEMM is a separate te.Linear whose input is cast by its own kernel.
    fused_norm_casts: bool = True
    source: str = "prior"  # where the figures come from

    def __post_init__(self) -> None:
        for name in ("gemm_efficiency", "attention_efficiency", "memory_efficiency"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and 0 < v <= 1):
                raise ConfigError("must be in (0, 1]", field=name, value=v, fix="give a fraction of peak, e.g. 0.7")
        if not (isinstance(self.kernel_overhead_us, int | float) and 0 <= self.kernel_overhead_us < 1e6):
            raise ConfigError("must be >= 0 (microseconds)", field="kernel_overhead_us", value=self.kernel_overhead_us,
                              fix="give the fixed cost of one kernel in microseconds, e.g. 5")

    @property
    def kernel_overhead_s(self) -> float:
        return self.kernel_overhead_us * 1e-6

    def to_dict(self) -> dict[str, object]:
        return {"gemm_efficiency": self.gemm_efficiency, "attention_efficiency": self.attention_efficiency,
                "kernel_overhead_us": self.kernel_overhead_us, "memory_efficiency": self.memory_efficiency,
                "k_half": self.k_half, "elementwise_kernels": self.elementwise_kernels,
                "fused_norm_casts": self.fused_norm_casts, "source": self.source}
