"""The async handle returned by `HetGroup` collectives, and the one communication error type."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any


class HetCommError(RuntimeError):
    """A hierarchical collective failed; the message names the group, this rank and missing ranks."""


class HetWork:
    """`.wait()` blocks until the collective is done and raises HetCommError if it failed."""

    def __init__(self, inner: Future | Any) -> None:
        self._inner = inner  # a concurrent Future (Python twin) or a torch Work (C++ backend)

    def wait(self) -> bool:
        try:
            if isinstance(self._inner, Future):
                self._inner.result()
            else:
                self._inner.wait()
        except HetCommError:
            raise
        except RuntimeError as exc:  # C++ errors arrive as DistBackendError with the same text
            raise HetCommError(str(exc)) from exc
        return True

    def is_completed(self) -> bool:
        if isinstance(self._inner, Future):
            return self._inner.done()
        return bool(self._inner.is_completed())
