"""The one exception type of the schedule layer."""

from __future__ import annotations


class ScheduleError(ValueError):
    """A schedule is malformed, incomplete or deadlocks.

    ``str()`` is ``"{field}: {problem} (got {value!r}). Fix: {fix}"``, followed by a rank x time
    grid on the next lines when one helps (deadlocks).
    """

    def __init__(
        self, *, field: str, value: object, problem: str, fix: str, grid: str | None = None
    ) -> None:
        self.field = field  # what is wrong, e.g. "actions[1][4]" or "num_micro_batches"
        self.value = value  # the offending value
        self.problem = problem  # what is wrong, with the limit when there is one
        self.fix = fix  # what to change
        self.grid = grid  # rendered grid of what ran before the problem, or None
        message = f"{field}: {problem} (got {value!r}). Fix: {fix}"
        super().__init__(message + ("\n" + grid if grid else ""))
