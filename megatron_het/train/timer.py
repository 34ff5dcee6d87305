"""The one emulation timer: measures compute and makes an emulated slower device wait for it.

On CPU a slower device type is emulated by waiting ``(slowdown - 1) x`` the measured time after
each forward/backward (and after the optimizer step). Every strategy measures its compute through
this object, so benches choose the clock here instead of patching a trainer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from megatron_het.cluster import ClusterSpec

T = TypeVar("T")


class EmulationTimer:
    """Accumulates one iteration's compute and emulated seconds (``reset`` starts the next)."""

    def __init__(self, *, slowdown: float = 1.0, clock: Callable[[], float] | None = None) -> None:
        self.slowdown = slowdown  # how much slower this rank's device is than the host (1.0: not emulated)
        # the clock whose elapsed time x slowdown is the emulated duration; None: wall time. A bench
        # on shared cores passes time.thread_time, so other processes' load does not stretch it
        self.clock = clock
        self.compute_s = 0.0  # forward + backward this iteration, emulated waiting included
        self.emulated_s = 0.0  # waiting added to emulate the slower device (compute and optimizer)

    def reset(self) -> None:
        self.compute_s = self.emulated_s = 0.0

    def _run(self, fn: Callable[[], T]) -> tuple[T, float]:
        """Run ``fn``, wait what the emulated device would need on top; (result, wall time incl. wait)."""
        c0, w0 = (self.clock() if self.clock is not None else 0.0), time.perf_counter()
        out = fn()
        wall = time.perf_counter() - w0
        if self.slowdown > 1.0:
            spent = wall if self.clock is None else self.clock() - c0
            extra = spent * self.slowdown - wall
            if extra > 0:
                time.sleep(extra)
                self.emulated_s += extra
                wall += extra
        return out, wall

    def compute(self, fn: Callable[[], T]) -> T:
        """A forward or backward: counted as compute, stretched to the emulated device's speed."""
        out, dt = self._run(fn)
        self.compute_s += dt
        return out

    def stretch(self, fn: Callable[[], T]) -> T:
        """Work a slower device also does slower but that is not forward/backward (the optimizer step)."""
        return self._run(fn)[0]


def emulation_timer(cluster: ClusterSpec | None, island: str, *, slowdown: float | None = None,
                    clock: Callable[[], float] | None = None) -> EmulationTimer:
    """The timer of a rank on ``island``: the cluster's emulated slowdown of that island (1.0 when the
    cluster emulates nothing), unless ``slowdown`` is given (1.0 turns emulation off)."""
    if slowdown is None:
        slowdown = cluster.slowdown(island) if cluster is not None and cluster.emulated else 1.0
    return EmulationTimer(slowdown=slowdown, clock=clock)
