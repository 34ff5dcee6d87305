"""Reading a JSON file someone else wrote: every way it can be unreadable is one ``FileProblem``.

Plans, profiles, Hugging Face configs and checkpoint metadata come from other people and other
tools. Missing, a directory, not UTF-8, not JSON, or nested deeply enough to exhaust the parser's
recursion must each end in one line naming the file, never a traceback. Callers turn the problem
into their own user error (PlanError, ConvertError, ...) with the fix that fits their file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["FileProblem", "read_json_file"]


class FileProblem(Exception):
    """Why a file could not be read as JSON; ``problem`` is one short clause (no file name)."""

    def __init__(self, problem: str, *, where: str = "(file)") -> None:
        super().__init__(problem if where == "(file)" else f"{problem} at {where}")
        self.problem = problem  # e.g. "not UTF-8 text (byte 3)", "invalid JSON (Expecting value)"
        self.where = where  # "(file)", or "line L column C" for a syntax error


def read_json_file(path: str | os.PathLike[str]) -> object:
    """The parsed document; FileProblem when the file cannot be read or parsed."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileProblem("file not found") from None
    except IsADirectoryError:
        raise FileProblem("is a directory, not a file") from None
    except UnicodeDecodeError as e:
        raise FileProblem(f"not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise FileProblem(f"cannot read the file ({e.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise FileProblem(f"invalid JSON ({e.msg})", where=f"line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise FileProblem("JSON nested too deeply") from None
