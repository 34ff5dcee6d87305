"""The planner's error: no plan fits, with the reasons."""

from __future__ import annotations

from megatron_het.errors import UserError


class InfeasibleError(UserError):
    """No candidate plan fits the cluster; ``str()`` is the whole explanation, ready to print."""

    def __init__(self, explanation: str, *, reasons: tuple[str, ...] = ()) -> None:
        self.explanation = explanation  # human message: which constraint failed, by how much, the fix
        self.reasons = reasons  # every pruning reason collected during the search
        super().__init__(message=explanation)
