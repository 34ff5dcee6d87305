"""The one atomic file writer: a reader sees the old file or the new one, never a partial one.

Every file the project writes (plans, sbatch scripts, tokenizers, corpora, reports) goes through
``write_bytes_atomic`` / ``write_text_atomic``: a temporary sibling in the same directory, fsync,
``os.replace``, then fsync of the directory so the rename itself survives a power loss. On any
error the temporary file is removed and an existing target is left untouched.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["fsync_dir", "write_bytes_atomic", "write_text_atomic"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or creation inside directory ``path`` durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` atomically; ``mode`` sets the permission bits (e.g. 0o755)."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(directory)


def write_text_atomic(path: str | os.PathLike[str], text: str, *, mode: int | None = None) -> None:
    """``write_bytes_atomic`` of ``text`` in UTF-8."""
    write_bytes_atomic(path, text.encode("utf-8"), mode=mode)
