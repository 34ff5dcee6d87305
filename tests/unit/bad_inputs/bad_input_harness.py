"""The contract every bad input must meet (#21), shared by the per-tool tables in this folder.

A row is one bad command line plus the files it needs. ``check_row`` runs the tool's ``main(argv)``
in-process in a fresh working directory and asserts: exit code 2; one error line on stderr (argparse
may print its usage block above it) that names the file or flag; no "Traceback"; no file created,
changed or removed in the working directory; done within ``ROW_LIMIT_S``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from support.paths import EXAMPLES, REPO

ROW_LIMIT_S = 10.0  # the bound for any bad input
HANG_GUARD_S = 30  # a row still running after this is stopped (so a hang fails one row, not the suite)

CPU_DEMO = str(EXAMPLES / "clusters" / "cpu-demo.yaml")
CPU_4 = str(EXAMPLES / "clusters" / "cpu-4.yaml")
TINY = str(EXAMPLES / "models" / "tiny-cpu.yaml")
DEMO_PLAN = str(EXAMPLES / "plans" / "cpu-demo-hetero.json")
CPU_DEMO_TEXT = Path(CPU_DEMO).read_text()
TINY_TEXT = Path(TINY).read_text()
DEMO_PLAN_TEXT = Path(DEMO_PLAN).read_text()
CORPUS = str(EXAMPLES / "data" / "corpus.jsonl")

NON_UTF8 = b"islands:\n  - name: \xff\xfe\xfa\n"  # invalid UTF-8 in any position
DEEP_JSON = "[" * 200_000 + "]" * 200_000  # deeper than Python's recursion limit
DEEP_YAML = "islands: " + "[" * 200_000 + "]" * 200_000 + "\n"  # flow sequences nested too deep
PYTHON_TAG_YAML = "!!python/object/apply:os.system [\"touch pwned\"]\n"
GARBAGE = b"\x00\x01\x02 not a file of this kind \x7f\x80\x81" * 8


@dataclass(frozen=True, kw_only=True)
class Row:
    """One bad input: the command line, what it needs on disk, and what the error must name."""

    id: str  # pytest id, e.g. "plan-cluster-missing"
    argv: tuple[str, ...]  # arguments after the program name; paths relative to the working directory
    names: tuple[str, ...]  # the error line must contain one of these (the file or the flag)
    files: dict[str, str | bytes] = field(default_factory=dict)  # relative path -> content, made before
    dirs: tuple[str, ...] = ()  # empty directories made before the run
    setup: Callable[[Path], None] | None = None  # anything else to prepare (e.g. a crafted checkpoint)


def snapshot(root: Path) -> dict[str, tuple[bool, int, int]]:
    """Every path under ``root`` with (is a directory, size, mtime in ns)."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            is_dir = path.is_dir() and not path.is_symlink()
            state[str(path.relative_to(root))] = (is_dir, 0 if is_dir else st.st_size, st.st_mtime_ns)
    return state


def prepare(row: Row, root: Path) -> None:
    for d in row.dirs:
        (root / d).mkdir(parents=True, exist_ok=True)
    for rel, content in row.files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    if row.setup is not None:
        row.setup(root)


def error_line(stderr: str) -> str:
    """The one error line; a usage block from argparse may precede it, nothing else may."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    if lines[0].startswith("usage:"):
        usage = [line for line in lines[:-1] if not line.startswith(("usage:", " "))]
        assert not usage, f"more than the usage block and one error line:\n{stderr}"
        return lines[-1]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    return lines[0]


def _substitute(arg: str, subs: dict[str, str]) -> str:
    for key, value in subs.items():
        arg = arg.replace("{" + key + "}", value)
    return arg


class _Hung(BaseException):
    pass


def _stop(signum, frame):
    raise _Hung()


def check_row(main: Callable[[list[str]], int], row: Row, root: Path, capsys, monkeypatch, *,
              subs: dict[str, str] | None = None) -> None:
    """Run ``main(row.argv)`` in ``root`` and assert the contract of the module docstring.

    ``subs`` replaces placeholders in the arguments (e.g. ``{sp}`` by a tokenizer made once per module).
    """
    argv = [_substitute(a, subs or {}) for a in row.argv]
    monkeypatch.chdir(root)
    prepare(row, root)
    before = snapshot(root)
    capsys.readouterr()
    previous = signal.signal(signal.SIGALRM, _stop)
    signal.alarm(HANG_GUARD_S)
    start = time.monotonic()
    try:
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    except _Hung:
        code = "hung"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert code != "hung", f"still running after {HANG_GUARD_S} s"
    assert "Traceback" not in err, err
    assert code == 2, f"exit code {code!r}, stderr:\n{err}\nstdout:\n{out[-2000:]}"
    line = error_line(err)
    assert any(name in line for name in row.names), f"the error names none of {row.names}: {line}"
    assert snapshot(root) == before, "the working directory changed"
    assert elapsed < ROW_LIMIT_S, f"took {elapsed:.1f} s"


def shim_command(tool: str, *argv: str) -> list[str]:
    """The command line a user types: ``python tools/<tool> ...`` (absolute path, any working directory)."""
    return [sys.executable, str(REPO / "tools" / tool), *argv]
