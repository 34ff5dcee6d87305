"""The one exception type of the launch layer."""

from __future__ import annotations

from megatron_het.errors import UserError


class LaunchError(UserError):
    """A cluster/plan/placement combination that cannot be turned into a job script.

    ``str()`` is the whole human message: ``"{field}: {problem} (got {value!r}). Fix: {fix}"``.
    """

    def __init__(self, *, field: str, value: object, problem: str, fix: str) -> None:
        # field: e.g. "--partition" or "plan.replicas[0].stages[1].island"
        super().__init__(problem, field=field, value=value, fix=fix)
