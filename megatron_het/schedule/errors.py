"""The one exception type of the schedule layer."""

from __future__ import annotations

from megatron_het.errors import UserError


class ScheduleError(UserError):
    """A schedule is malformed, incomplete or deadlocks.

    ``str()`` is ``"{field}: {problem} (got {value!r}). Fix: {fix}"``, followed by a rank x time
    grid on the next lines when one helps (deadlocks).
    """

    def __init__(
        self, *, field: str, value: object, problem: str, fix: str, grid: str | None = None
    ) -> None:
        # field: e.g. "actions[1][4]" or "num_micro_batches"
        self.grid = grid  # rendered grid of what ran before the problem, or None
        super().__init__(problem, field=field, value=value, fix=fix)
        if grid:
            self.args = (self.format() + "\n" + grid,)
