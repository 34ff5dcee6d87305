"""The async handle returned by `HetGroup` collectives, and the one communication error type."""

from __future__ import annotations

import datetime
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any


class HetCommError(RuntimeError):
    """A hierarchical collective failed; the message names the group, this rank and missing ranks."""


class HetWork:
    """`.wait()` blocks until the collective is done and raises HetCommError if it failed."""

    def __init__(self, inner: Future | Any) -> None:
        self._inner = inner  # a concurrent Future (Python twin) or a torch Work (C++ backend)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """``timeout`` bounds this wait (None: until the collective ends, itself bounded by the group's
        timeout); when it passes first, HetCommError says so and the collective keeps running."""
        try:
            if isinstance(self._inner, Future):
                self._inner.result(timeout=None if timeout is None else timeout.total_seconds())
            elif timeout is None:
                self._inner.wait()
            else:
                self._inner.wait(timeout)
        except HetCommError:
            raise
        except FutureTimeout:
            raise HetCommError(f"het: Work.wait timed out after {timeout.total_seconds() * 1e3:.0f} ms; the collective "
                               "is still queued or running on the group's worker thread. Fix: wait longer, or check "
                               "that every rank of the group calls the same collectives in the same order") from None
        except RuntimeError as exc:  # C++ errors arrive as DistBackendError with the same text
            raise HetCommError(str(exc)) from exc
        return True

    def is_completed(self) -> bool:
        if isinstance(self._inner, Future):
            return self._inner.done()
        return bool(self._inner.is_completed())
