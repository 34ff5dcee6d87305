"""The one exception type of the plan layer."""

from __future__ import annotations


class PlanError(ValueError):
    """A plan is malformed or does not fit the model or cluster.

    ``str()`` is the whole human message:
    ``"{file}: {field}: {problem} (got {value!r}). Fix: {fix}"`` (the file part only when known).
    """

    def __init__(
        self, *, field: str, value: object, problem: str, fix: str, file: str | None = None
    ) -> None:
        self.file = file  # plan file the bad value came from, when known
        self.field = field  # dotted/indexed path, e.g. "replicas[1].stages[0].ranks"
        self.value = value  # the offending value
        self.problem = problem  # what is wrong, with the limit when there is one
        self.fix = fix  # what the user should change
        prefix = f"{file}: " if file else ""
        super().__init__(f"{prefix}{field}: {problem} (got {value!r}). Fix: {fix}")
