"""Emulated device capacity: a per-rank byte budget checked against the memory model.

On CPU nothing runs out of memory, so an emulated small GPU is a budget: before training, the
rank's peak (``perf.sharded.sharded_rank_memory`` at the runtime's fp32 precision, with the
rank's real parameter count, shard fraction, micro-batch size and recompute choice) must fit.
"""

from __future__ import annotations

from megatron_het.errors import UserError
from megatron_het.perf.memory import StageMemory

__all__ = ["MemoryBudgetError", "check_budget"]


class MemoryBudgetError(UserError):
    """A rank's predicted peak exceeds its emulated memory budget."""

    def __init__(self, message: str, *, rank: int, needed_bytes: int, budget_bytes: int) -> None:
        self.rank = rank  # the rank that does not fit
        self.needed_bytes = needed_bytes  # its predicted peak
        self.budget_bytes = budget_bytes  # its budget
        super().__init__(message)


def check_budget(memory: StageMemory, *, rank: int, budget_bytes: int, shard_fraction: float) -> None:
    """Raise MemoryBudgetError naming the rank, both byte counts, the largest part and the fix."""
    need = memory.total_bytes
    if need <= budget_bytes:
        return
    room = budget_bytes - (need - memory.optimizer_bytes)
    raise MemoryBudgetError(
        f"memory_budget_bytes[{rank}]: rank {rank} needs {need} bytes at its peak but its budget is "
        f"{budget_bytes} bytes (largest part: {memory.largest_part()}; state shard {memory.optimizer_bytes} "
        f"bytes at shard_fraction {shard_fraction:.4f}, room for {max(room, 0)}). Fix: lower this rank's "
        "shard_fraction (plan_sharded with shard_policy='memory'), its micro-batch size, or enable recompute",
        rank=rank, needed_bytes=need, budget_bytes=budget_bytes)
