"""The one atomic file writer: a reader sees the old file or the new one, never a partial one.

Every file the project writes (plans, sbatch scripts, tokenizers, corpora, reports) goes through
``write_bytes_atomic`` / ``write_text_atomic``: a temporary sibling in the same directory, fsync,
``os.replace``, then fsync of the directory so the rename itself survives a power loss. On any
error the temporary file is removed and an existing target is left untouched.

Permissions are those ``open()`` / ``mkdir`` would give (0666 / 0777 less the umask), not the 0600 /
0700 that ``mkstemp`` / ``mkdtemp`` use for their private temporaries.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["current_umask", "default_dir_mode", "default_file_mode", "fsync_dir", "write_bytes_atomic",
           "write_text_atomic"]


def current_umask() -> int:
    """The process umask, read without changing it where the kernel reports it (Linux /proc), else by
    setting and restoring it (briefly racy with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """What ``open(path, "w")`` would create: 0666 less the umask."""
    return 0o666 & ~current_umask()


def default_dir_mode() -> int:
    """What ``os.mkdir`` would create: 0777 less the umask."""
    return 0o777 & ~current_umask()


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
        os.chmod(tmp, default_file_mode() if mode is None else mode)  # mkstemp made it 0600
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(directory)


def write_text_atomic(path: str | os.PathLike[str], text: str, *, mode: int | None = None) -> None:
    """``write_bytes_atomic`` of ``text`` in UTF-8."""
    write_bytes_atomic(path, text.encode("utf-8"), mode=mode)
