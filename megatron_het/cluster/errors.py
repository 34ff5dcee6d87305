"""The one error type for bad user input in cluster and model files."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from megatron_het.errors import UserError

__all__ = ["ConfigError", "suggest"]


class ConfigError(UserError):
    """Bad user input. ``str(err)`` is the whole human message, ready to print.

    Format: ``"{file}: {field}: {problem} (got {value!r}). Fix: {fix}"``; the ``file``
    part is left out when the input did not come from a file.
    """

    def __init__(
        self,
        problem: str,
        *,
        field: str,
        value: object,
        fix: str,
        file: str | None = None,
    ) -> None:
        super().__init__(problem, field=field, value=value, fix=fix, file=file)

    def located(self, *, file: str | None = None, prefix: str = "") -> ConfigError:
        """Same error with ``prefix`` put before the field path and ``file`` filled in.

        Dataclasses validate their own fields ("nodes"); the loader knows where the object
        sits in the file ("islands[1]") and which file it is, so it relocates the error.
        """
        field = f"{prefix}.{self.field}" if prefix and self.field else (prefix or self.field)
        return ConfigError(
            self.problem,
            field=field,
            value=self.value,
            fix=self.fix,
            file=file if file is not None else self.file,
        )


def suggest(word: str, choices: Iterable[str], *, what: str) -> str:
    """A "did you mean" fix listing the nearest ``choices`` to ``word`` (difflib)."""
    options = sorted(choices)
    # A prefix ("V100" -> "V100-32GB") beats any fuzzy match; difflib ranks such pairs poorly.
    close = [o for o in options if word and o.lower().startswith(str(word).lower())][:3]
    if not close:
        close = difflib.get_close_matches(str(word), options, n=3, cutoff=0.5)
    if not close:
        # Case-insensitive second try: "a100-80gb" should still find "A100-80GB".
        lowered = {o.lower(): o for o in options}
        close = [lowered[c] for c in difflib.get_close_matches(str(word).lower(), list(lowered), n=3, cutoff=0.5)]
    if close:
        return f"did you mean {' or '.join(repr(c) for c in close)}? Valid {what}: {', '.join(options)}"
    return f"use one of the valid {what}: {', '.join(options)}"
