"""What every plan kind offers: the one interface launch, tools and the entry point program against.

Two kinds implement it: the pipeline ``Plan`` (plan/types.py: replicas of TP/PP stages) and the
``ShardedPlan`` (plan/sharded.py: one uneven sharded data-parallel group). Files of either kind are
read by ``load_any_plan`` (plan/serialize.py). Pricing a plan is the performance model's job
(perf/), not the plan's: it would make the plan package depend on perf.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from megatron_het.cluster import ClusterSpec, ModelSpec

__all__ = ["AnyPlan", "MemoryCheck"]


@runtime_checkable
class AnyPlan(Protocol):
    """A plan of either kind."""

    @property
    def world_size(self) -> int:
        """Number of ranks the plan runs on (global ranks 0..world_size-1)."""

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step."""

    @property
    def predicted(self) -> Mapping[str, object] | None:
        """Performance-model figures attached by the planner, or None."""

    def island_ranks(self) -> dict[str, tuple[int, ...]]:
        """Island name -> the global ranks the plan places there (ascending), islands in plan order."""

    def validate(self, model: ModelSpec, cluster: ClusterSpec | None = None, *,
                 memory_check: MemoryCheck | None = None) -> None:
        """Raise PlanError for the first problem found against the model (and cluster, when given)."""

    def describe(self) -> list[str]:
        """Human lines: a header, one line per replica or rank, the prediction when there is one."""

    def to_dict(self) -> dict:
        """JSON-ready dict, with the "format" and "version" keys that ``load_any_plan`` dispatches on."""

    def to_json(self) -> str:
        """Indented JSON text ending with a newline."""

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the JSON atomically (utils/atomic.py)."""


# Called last by ``validate`` with (plan, model, cluster); raises a UserError when the plan does not
# fit in device memory. Supplied by the performance model (megatron_het.perf).
MemoryCheck = Callable[["AnyPlan", "ModelSpec", "ClusterSpec | None"], None]
