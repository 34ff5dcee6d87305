"""Pure chunking rules for collective/GEMM overlap (no processes, no tensors).

A sequence-parallel shard of ``rows`` rows is cut into ``chunks`` equal pieces along the sequence
dim; the collective of piece ``i + 1`` runs while piece ``i``'s GEMM computes. Equal pieces keep
every rank's collective the same size (gloo and NCCL need that for the tensor collectives).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OverlapConfig", "effective_chunks"]


@dataclass(frozen=True, kw_only=True)
class OverlapConfig:
    """How a stage's tensor-parallel layers overlap their collectives with their GEMMs."""

    chunks: int = 4  # pieces per GEMM along the sequence dim; 1 = no overlap (Megatron's plain path)
    overlap: bool = True  # False: same chunking, blocking collectives (isolates the chunking cost)

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 1:
            raise ValueError(f"OverlapConfig.chunks: must be an int >= 1, got {self.chunks!r} "
                             f"(limit 1). Fix: pass chunks=1 for no overlap or e.g. chunks=4")


def effective_chunks(rows: int, chunks: int) -> int:
    """The largest divisor of ``rows`` that is ``<= chunks`` (pieces must be equal on every rank).

    A sequence shard of 6 rows with ``chunks=4`` runs 3 pieces; a prime row count runs 1 piece
    (no overlap) rather than failing mid-training.
    """
    if rows < 1:
        raise ValueError(f"rows: the local sequence shard must have >= 1 row, got {rows} (limit 1). "
                         f"Fix: make seq_length a multiple of the tensor-parallel size")
    if chunks < 1:
        raise ValueError(f"chunks: must be >= 1, got {chunks} (limit 1). Fix: pass chunks=1 for no overlap")
    for c in range(min(chunks, rows), 0, -1):
        if rows % c == 0:
            return c
    return 1  # unreachable: 1 divides everything
