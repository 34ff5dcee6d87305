"""Sizes past which an input is a typo, not a training run (#21).

The planner and the predictor price every replica's micro-batches; a global batch of 10^12 is
not a configuration anyone trains, and pricing it would only burn time. Values beyond these
bounds are refused with an error naming the value, the bound and why; everything below them is
priced in time independent of the micro-batch count (schedule/steady.py).
"""

from __future__ import annotations

from megatron_het.plan import PlanError

__all__ = ["MAX_GLOBAL_BATCH_SIZE", "check_global_batch_size"]

# Sequences per iteration: 1000x the largest published LLM runs (~16K sequences of 4K tokens).
MAX_GLOBAL_BATCH_SIZE = 1 << 24


def check_global_batch_size(value: object, *, field: str = "global_batch_size", file: str | None = None) -> None:
    """Raise PlanError unless ``value`` is an integer in [1, MAX_GLOBAL_BATCH_SIZE]."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(field=field, value=value, problem="must be an integer >= 1 (sequences per iteration)",
                        fix="pass a positive global batch size", file=file)
    if value > MAX_GLOBAL_BATCH_SIZE:
        raise PlanError(field=field, value=value,
                        problem=f"exceeds the bound {MAX_GLOBAL_BATCH_SIZE:,} sequences per iteration (1000x the "
                                "largest published training runs; a larger value is a typo)",
                        fix="pass the global batch size in sequences, e.g. 512", file=file)
