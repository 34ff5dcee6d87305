"""The one exception type of the plan layer."""

from __future__ import annotations

from megatron_het.errors import UserError


class PlanError(UserError):
    """A plan is malformed or does not fit the model or cluster.

    ``str()`` is the whole human message:
    ``"{file}: {field}: {problem} (got {value!r}). Fix: {fix}"`` (the file part only when known).
    """

    def __init__(
        self, *, field: str, value: object, problem: str, fix: str, file: str | None = None
    ) -> None:
        # field: dotted/indexed path, e.g. "replicas[1].stages[0].ranks"; file: the plan file, when known
        super().__init__(problem, field=field, value=value, fix=fix, file=file)

    def with_file(self, file: str | None) -> PlanError:
        """The same error naming ``file`` (types check themselves without knowing where they were read)."""
        if file is None or self.file is not None:
            return self
        return PlanError(field=self.field, value=self.value, problem=self.problem, fix=self.fix, file=file)
