"""Uneven all-gather / reduce-scatter: they live in the comm layer (``megatron_het/comm/uneven.py``),
once for every caller; re-exported here for existing imports."""

from megatron_het.comm.uneven import GATHER_METHODS, REDUCE_SCATTER_METHODS, uneven_all_gather, uneven_reduce_scatter

__all__ = ["uneven_all_gather", "uneven_reduce_scatter", "GATHER_METHODS", "REDUCE_SCATTER_METHODS"]
