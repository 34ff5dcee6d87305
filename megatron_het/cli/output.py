"""Refuse an output file the tool could not write, before any work is done (#21).

A tool that searches or measures for minutes and then fails on ``--output`` wastes the run; these
checks run first and raise a one-line ``UserError`` naming the flag and the path.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from megatron_het.errors import UserError

__all__ = ["check_output_file", "quiet_on_broken_pipe", "undo_created_dirs"]


def check_output_file(path: str | os.PathLike[str], *, flag: str) -> None:
    """``path`` must not be a directory and its parent must be an existing, writable directory."""
    target = Path(path)
    if target.is_dir():
        raise UserError("is a directory", field=flag, value=str(path),
                        fix=f"pass a file name for {flag}, e.g. {target / 'out.json'}")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.exists():
        for up in parent.parents:  # a file where a directory is expected reads better than "missing"
            if up.exists() and not up.is_dir():
                break
        else:
            raise UserError(f"the directory {str(parent)!r} does not exist", field=flag, value=str(path),
                            fix=f"create it first (mkdir -p {parent}) or pass another {flag}")
    if not parent.is_dir():
        raise UserError("its parent is not a directory", field=flag, value=str(path),
                        fix=f"pass a path inside a directory for {flag}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"the directory {str(parent)!r} is not writable", field=flag, value=str(path),
                        fix=f"pass a {flag} in a directory you can write")


def quiet_on_broken_pipe(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap a tool's ``main`` so that a reader closing the pipe early (``tool | head -3``) ends the tool
    quietly with exit code 1 instead of a BrokenPipeError traceback (the pattern in Python's signal
    docs: flush inside the guard, then point stdout at devnull so the exit-time flush cannot fail)."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            rc = main(*args, **kwargs)
            sys.stdout.flush()
            return rc
        except BrokenPipeError:
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
            except (OSError, ValueError, AttributeError):  # stdout without a descriptor (captured in tests)
                pass
            return 1

    return wrapper


@contextlib.contextmanager
def undo_created_dirs(directory: str | os.PathLike[str]) -> Iterator[None]:
    """On an error inside the block, remove the directories on the way to ``directory`` that did not
    exist before it (deepest first, each only while still empty): a tool that promises to write nothing
    on failure leaves no ``--output-prefix nodir/sub/`` behind."""
    missing = []
    here = Path(os.path.abspath(directory))
    while not here.exists() and here != here.parent:
        missing.append(here)
        here = here.parent
    try:
        before = here.stat() if missing else None  # the existing ancestor: its times are restored too
    except OSError:
        before = None
    try:
        yield
    except BaseException:
        for d in missing:  # deepest first
            try:
                d.rmdir()
            except OSError:  # not created, not empty (another writer's files), or not ours to remove
                break
        else:
            if before is not None:
                with contextlib.suppress(OSError):
                    os.utime(here, ns=(before.st_atime_ns, before.st_mtime_ns))
        raise
