"""The one exception type of the launch layer."""

from __future__ import annotations


class LaunchError(ValueError):
    """A cluster/plan/placement combination that cannot be turned into a job script.

    ``str()`` is the whole human message: ``"{field}: {problem} (got {value!r}). Fix: {fix}"``.
    """

    def __init__(self, *, field: str, value: object, problem: str, fix: str) -> None:
        self.field = field  # what is wrong, e.g. "--partition" or "plan.replicas[0].stages[1].island"
        self.value = value  # the offending value
        self.problem = problem  # what is wrong, with the limit when there is one
        self.fix = fix  # what the user should change
        super().__init__(f"{field}: {problem} (got {value!r}). Fix: {fix}")
