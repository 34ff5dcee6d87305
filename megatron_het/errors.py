"""The one base class for bad user input, shared by every layer.

A ``UserError`` is the user's to fix (a cluster file with a typo, a plan that does not fit, a
checkpoint from another model); entry points print ``str(err)`` on one line and exit with code 2.
Anything else that escapes is a bug and surfaces as a traceback.
"""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(ValueError):
    """Bad user input. ``str(err)`` is the whole human message, ready to print.

    Format: ``"{file}: {field}: {problem} (got {value!r}). Fix: {fix}"``; the file part only when
    the input came from a file. Errors whose explanation does not fit that shape (the planner's
    infeasibility report, messages written whole) pass ``message=`` or just the message as
    the only argument.
    """

    def __init__(self, problem: str = "", *, field: str = "", value: object = None, fix: str = "",
                 file: str | None = None, message: str | None = None) -> None:
        self.problem = problem  # what is wrong, with the limit when there is one, e.g. "must be >= 1"
        self.field = field  # path to the offending field or flag, e.g. "islands[1].device" or "--plan"
        self.value = value  # the offending value as read
        self.fix = fix  # what the user should change
        self.file = file  # the file the value came from, None for in-code or command-line input
        if message is None and not field:  # UserError("whole message")
            message = problem
        super().__init__(message if message is not None else self.format())

    def format(self) -> str:
        where = f"{self.file}: " if self.file else ""
        return f"{where}{self.field}: {self.problem} (got {self.value!r}). Fix: {self.fix}"
