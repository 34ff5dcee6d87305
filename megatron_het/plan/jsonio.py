"""Plan JSON text and files, for every plan kind; knows nothing of the plan types.

Writing goes through the one atomic writer (utils/atomic.py); reading turns every way a file can
be unreadable (missing, a directory, not UTF-8, not JSON, nested too deeply) into one PlanError
naming the file.
"""

from __future__ import annotations

import json
import os
import re

from megatron_het.plan.errors import PlanError
from megatron_het.utils.atomic import write_text_atomic
from megatron_het.utils.json_file import FileProblem, read_json_file

__all__ = ["json_text", "read_json", "write_json"]

# Only structural arrays match: json.dumps escapes newlines inside strings, so "[\n" is never in one.
_NUMBER_LIST = re.compile(r"\[\n\s*(-?\d+(?:,\n\s*-?\d+)*)\n\s*\]")


def json_text(d: dict) -> str:
    """Indented JSON with a trailing newline; integer lists (ranks, layers) on one line."""
    text = json.dumps(d, indent=2)
    one_line = _NUMBER_LIST.sub(lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]", text)
    return one_line + "\n"


def write_json(path: str | os.PathLike[str], d: dict) -> None:
    """``json_text(d)`` written atomically (temp sibling, fsync, rename)."""
    write_text_atomic(path, json_text(d))


def read_json(path: str | os.PathLike[str]) -> object:
    """The parsed JSON document of a plan file; PlanError (naming the file) when it cannot be read."""
    try:
        return read_json_file(path)
    except FileProblem as e:
        raise PlanError(file=str(path), field=e.where, value=str(path), problem=e.problem,
                        fix="pass a plan JSON file written by tools/plan.py" if e.where == "(file)"
                        else "correct the JSON syntax") from None
