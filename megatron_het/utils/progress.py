"""A progress display for long tools (checkpoint conversion, planning, preprocessing).

Library functions never print: they take a ``progress(done, total)`` callback
(:data:`ProgressCallback`) and the tool passes :meth:`Progress.update`. On a terminal the status is
one line redrawn in place; in a log file (not a TTY) a plain line is written at most every
``interval_s`` seconds, plus a final one; ``quiet=True`` (the tools' ``--no-progress``) writes nothing.

    with Progress("convert", unit="tensors") as bar:
        convert(request, progress=bar.update)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TextIO

ProgressCallback = Callable[[int, int], None]  # (done, total); total may grow while the work is discovered

_TTY_REDRAW_S = 0.1  # a terminal line is redrawn at most this often


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


def format_progress(label: str, done: int, total: int | None, elapsed_s: float, *, unit: str,
                    final: bool = False) -> str:
    """One status line: ``label: done/total unit (pct) rate unit/s, ETA h:mm:ss`` (pure)."""
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    count = f"{done}/{total}" if total else f"{done}"
    pct = f" ({100.0 * done / total:5.1f}%)" if total else ""
    text = f"{label}: {count} {unit}{pct}, {rate:.4g} {unit}/s"
    if final:
        return text + f", done in {_duration(elapsed_s)}"
    if total and rate > 0 and done < total:
        text += f", ETA {_duration((total - done) / rate)}"
    return text


class Progress:
    """Context manager reporting ``done`` out of ``total`` units on ``stream`` (default stderr).

    ``update(done, total)`` sets absolute counts (it is a :data:`ProgressCallback`); ``advance(n)``
    adds to them. The rate is the mean since the start; the ETA assumes it holds. On exit a final
    line is written (marked ``interrupted`` when the block raised).
    """

    def __init__(self, label: str, total: int | None = None, *, unit: str = "items", quiet: bool = False,
                 stream: TextIO | None = None, interval_s: float = 5.0, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: got {interval_s}, it must be > 0 seconds. "
                             f"Fix: pass a positive interval such as 5.0")
        self.label, self.unit, self.quiet = label, unit, quiet  # what is counted, and whether to print
        self.total = total  # None: unknown (no percentage, no ETA)
        self.done = 0  # units finished so far
        self.stream = sys.stderr if stream is None else stream  # resolved now: tests swap sys.stderr
        self.tty = (hasattr(self.stream, "isatty") and self.stream.isatty()) if tty is None else tty
        self.interval_s = _TTY_REDRAW_S if self.tty else interval_s  # minimum time between two writes
        self.clock = clock  # injectable for tests
        self.start = clock()
        self.last_write: float | None = None  # time of the last status write
        self.width = 0  # length of the line on screen (TTY: blanked when the next one is shorter)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(interrupted=exc_type is not None)

    def update(self, done: int, total: int | None = None) -> None:
        """Set the counts (monotone callers: done only grows); writes when the interval has passed."""
        self.done = done
        if total is not None:
            self.total = total
        now = self.clock()
        if self.last_write is None or now - self.last_write >= self.interval_s:
            self._write(format_progress(self.label, self.done, self.total, now - self.start, unit=self.unit))
            self.last_write = now

    def advance(self, n: int = 1) -> None:
        self.update(self.done + n)

    def close(self, *, interrupted: bool = False) -> None:
        text = format_progress(self.label, self.done, self.total, self.clock() - self.start, unit=self.unit,
                               final=not interrupted)
        self._write(text + (" (interrupted)" if interrupted else ""), end=True)

    def _write(self, text: str, *, end: bool = False) -> None:
        if self.quiet:
            return
        if self.tty:
            self.stream.write("\r" + text.ljust(self.width) + ("\n" if end else ""))
            self.width = 0 if end else len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def add_progress_argument(parser: argparse.ArgumentParser) -> None:
    """The tools' ``--no-progress`` flag (progress goes to stderr; stdout keeps the results)."""
    parser.add_argument("--no-progress", action="store_true",
                        help="do not show the progress line on stderr")
