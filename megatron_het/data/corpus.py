"""Build the shipped example corpus from the docstrings of Python's standard library.

Why docstrings: they are real English prose about programming, present on every machine with
Python (no download), and under the PSF license, which allows redistribution. Parsing with ``ast``
(never importing) keeps extraction side-effect free and deterministic for a given Python build.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from megatron_het.data.jsonl import DataInputError
from megatron_het.utils.atomic import write_bytes_atomic

# Folders of the stdlib that hold tests, vendored data or platform-specific tooling, not prose.
SKIPPED_PARTS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                           "encodings", "lib2to3", "ensurepip", "turtledemo", "pydoc_data"})


@dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    """What to extract and how much."""

    stdlib_dir: Path  # root of the Python standard library to read (see default_stdlib_dir)
    max_bytes: int = 1_000_000  # stop adding modules once the JSONL output would exceed this size
    min_chars: int = 200  # modules whose docstrings total fewer characters are skipped (too little prose)

    def __post_init__(self) -> None:
        if self.max_bytes < 1_000:
            raise DataInputError(f"max_bytes: got {self.max_bytes}, the minimum is 1000. "
                             "Fix: ask for at least 1000 bytes of corpus.")
        if self.min_chars < 0:
            raise DataInputError(f"min_chars: got {self.min_chars}, the minimum is 0. Fix: pass 0 or more.")
        if not self.stdlib_dir.is_dir():
            raise DataInputError(f"stdlib_dir: {str(self.stdlib_dir)!r} is not a directory. "
                             "Fix: pass the Python standard library folder (e.g. .../lib/python3.11).")


def default_stdlib_dir() -> Path:
    """The standard library of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def module_document(source: str, module: str) -> str:
    """One document: the module docstring, then each class's and function's docstring under its name.

    Returns "" when the source has no docstrings or does not parse (a few stdlib files are
    deliberately invalid test inputs).
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts: list[str] = []
    head = ast.get_docstring(tree, clean=True)
    if head:
        parts.append(f"Module {module}.\n\n{head}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                parts.append(f"The {kind} {node.name}: {inspect.cleandoc(doc)}")
    return "\n\n".join(parts)


def python_files(root: Path) -> list[Path]:
    """Sorted ``.py`` files under ``root``, not descending into SKIPPED_PARTS (site-packages is large)."""
    found: list[Path] = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in SKIPPED_PARTS]
        found.extend(Path(folder) / f for f in files if f.endswith(".py") and not f.startswith("test_"))
    return sorted(found)


def stdlib_documents(config: CorpusConfig) -> list[str]:
    """Documents in sorted module order, stopping before the JSONL size would pass max_bytes."""
    documents: list[str] = []
    size = 0
    for path in python_files(config.stdlib_dir):
        rel = path.relative_to(config.stdlib_dir)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        text = module_document(path.read_text(encoding="utf-8", errors="replace"), module)
        if len(text) < config.min_chars:
            continue
        line_bytes = len(json.dumps({"text": text}).encode("utf-8")) + 1
        if size + line_bytes > config.max_bytes:
            break
        documents.append(text)
        size += line_bytes
    return documents


def check_output(path: Path) -> None:
    """Refuse an output the corpus could not be written to, before the standard library is read."""
    if path.is_dir():
        raise DataInputError(f"output: {str(path)!r} is a directory. Fix: pass --output FILE.jsonl")
    for up in path.parents:  # the nearest existing ancestor must be a directory
        if up.exists():
            if not up.is_dir():
                raise DataInputError(f"output: {str(path)!r}: {str(up)!r} is a file, not a directory. "
                                     "Fix: pass --output inside a directory")
            break


def write_jsonl(texts: list[str], path: Path, *, key: str = "text") -> int:
    """Write one ``{key: text}`` object per line (atomically); returns the number of bytes written."""
    check_output(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = "".join(json.dumps({key: t}) + "\n" for t in texts).encode("utf-8")
    write_bytes_atomic(path, payload)  # readers see the old file or the new one, never a partial one
    return len(payload)
