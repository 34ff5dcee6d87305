"""Read the text field of a JSONL corpus, with errors that point at the offending line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from megatron_het.errors import UserError


class DataInputError(UserError):
    """A corpus, tokenizer or dataset input is missing or malformed; str() is the whole message."""


def require_file(path: Path, *, field: str, fix: str) -> Path:
    """Return ``path`` if it is an existing file, else raise DataInputError naming ``field``."""
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise DataInputError(f"{field}: {str(path)!r} {what}. Fix: {fix}")
    return path


def read_jsonl_texts(path: Path, keys: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield ``(line_number, {key: text})`` for each non-blank line (1-based line numbers).

    Every line must be a JSON object holding a string under each of ``keys``; blank lines (such as
    a trailing newline) are skipped.
    """
    require_file(path, field="input", fix="pass an existing JSONL file (one {\"text\": ...} object per line).")
    with path.open("rb") as lines:  # decoded per line, so an encoding error names its line
        for number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataInputError(f"{path}:{number}: not UTF-8 text (byte {raw[err.start]:#04x} at column "
                                     f"{err.start + 1}). Fix: convert the file to UTF-8 (e.g. iconv -t UTF-8)."
                                     ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataInputError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno}). "
                                     "Fix: write one JSON object per line.") from None
            except RecursionError:
                raise DataInputError(f"{path}:{number}: JSON nested too deeply to read. "
                                     "Fix: write one flat JSON object per line, e.g. {\"text\": \"...\"}.") from None
            if not isinstance(record, dict):
                raise DataInputError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}. "
                                     "Fix: write one JSON object per line, e.g. {\"text\": \"...\"}.")
            texts: dict[str, str] = {}
            for key in keys:
                if key not in record:
                    raise DataInputError(
                        f"{path}:{number}: json key {key!r} is missing (keys on this line: {sorted(record)}). "
                        f"Fix: pass --json-keys with one of those keys, or add {key!r} to every line.")
                value = record[key]
                if not isinstance(value, str):
                    raise DataInputError(f"{path}:{number}: json key {key!r} holds a {type(value).__name__}, "
                                         "not a string. Fix: store the document text as a JSON string.")
                texts[key] = value
            yield number, texts
