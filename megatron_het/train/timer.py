"""The one emulation timer: measures compute and makes an emulated slower device wait for it.

On CPU a slower device type is emulated by waiting ``(slowdown - 1) x`` the measured time after
each forward/backward (and after the optimizer step). Every strategy measures its compute through
this object, so benches choose the clock here instead of patching a trainer.

On a GPU the work is asynchronous: a host clock around a forward would measure its kernel launches.
With ``events`` (the accelerator's ``event``: CUDA/HIP timing events) each forward/backward is
bracketed by two recorded events and the elapsed times are read when ``compute_s`` is read (after
the step, whose world all-reduce of the gradient norm goes through the host and so has waited for
the device anyway): no synchronisation per micro-batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from megatron_het.cluster import ClusterSpec

T = TypeVar("T")


class EmulationTimer:
    """Accumulates one iteration's compute and emulated seconds (``reset`` starts the next)."""

    def __init__(self, *, slowdown: float = 1.0, clock: Callable[[], float] | None = None,
                 events: Callable[[], Any] | None = None) -> None:
        self.slowdown = slowdown  # how much slower this rank's device is than the host (1.0: not emulated)
        # the clock whose elapsed time x slowdown is the emulated duration; None: wall time. A bench
        # on shared cores passes time.thread_time, so other processes' load does not stretch it
        self.clock = clock
        # timing-event factory (Accelerator.event) for un-emulated compute; None: the host clock
        self.events = events
        self._compute_s = 0.0  # forward + backward this iteration measured so far, emulated waiting included
        self._pending: list[tuple[Any, Any]] = []  # recorded (start, end) events not yet read
        self.emulated_s = 0.0  # waiting added to emulate the slower device (compute and optimizer)
        # catch_up: time the host took beyond the emulated duration (this rank preempted mid-action on
        # shared cores, a late wake-up from the emulation's sleep) is paid back from the rank's next sleeps,
        # so its timeline keeps to clock time x slowdown; off: each action lasts max(wall, clock x slowdown)
        self.catch_up = False
        self.lag_s = 0.0  # with catch_up: how far this rank runs behind its emulated timeline, not yet repaid
        # held around each timed call when set (a context manager factory, e.g. a lock shared by the ranks
        # emulated on one host: their compute then never runs at once and cannot inflate each other's CPU
        # time through the shared caches). Only for compute without collectives (TP = 1): a rank waiting
        # for a peer inside it would hold the lock the peer needs. Waiting for it costs no CPU time; with
        # catch_up it is repaid like any host lag
        self.host_lock: Callable[[], Any] | None = None

    @property
    def compute_s(self) -> float:
        """Forward + backward this iteration (reads the recorded events: waits for them)."""
        if self._pending:
            self._pending[-1][1].synchronize()
            self._compute_s += sum(s.elapsed_time(e) for s, e in self._pending) / 1000.0
            self._pending.clear()
        return self._compute_s

    def reset(self) -> None:
        self._compute_s = self.emulated_s = 0.0
        self._pending.clear()

    def _run(self, fn: Callable[[], T]) -> tuple[T, float]:
        """Run ``fn``, wait what the emulated device would need on top; (result, wall time incl. wait)."""
        device = self.events is not None and self.slowdown > 1.0  # a GPU: fn only launches its kernels
        if device:  # time them on the device: the stream's earlier waits (a pipeline receive) come before start
            start = self.events()
            start.record()
        w0 = time.perf_counter()
        if self.host_lock is None:
            c0 = self.clock() if self.clock is not None else 0.0
            out = fn()
        else:
            with self.host_lock():
                c0 = self.clock() if self.clock is not None else 0.0
                out = fn()
        if device:
            end = self.events()
            end.record()
            end.synchronize()
            wall = start.elapsed_time(end) / 1000.0  # the compute alone, stretched below
        else:
            wall = time.perf_counter() - w0
        if self.slowdown > 1.0:
            spent = wall if self.clock is None else self.clock() - c0
            extra = spent * self.slowdown - wall
            if self.catch_up:
                return out, self._catch_up(wall, extra)
            if extra > 0:
                time.sleep(extra)
                self.emulated_s += extra
                wall += extra
        return out, wall

    def _catch_up(self, wall: float, extra: float) -> float:
        """Sleep ``extra`` less the lag owed; the lag becomes what is left unpaid (or the sleep's late wake-up)."""
        extra -= self.lag_s
        if extra <= 0:
            self.lag_s = -extra
            return wall
        t0 = time.perf_counter()
        time.sleep(extra)
        slept = time.perf_counter() - t0
        self.lag_s = max(0.0, slept - extra)
        self.emulated_s += slept
        return wall + slept

    def compute(self, fn: Callable[[], T]) -> T:
        """A forward or backward: counted as compute, stretched to the emulated device's speed."""
        if self.events is not None and self.slowdown <= 1.0 and self.clock is None:
            start, end = self.events(), self.events()
            start.record()
            out = fn()
            end.record()
            self._pending.append((start, end))
            return out
        out, dt = self._run(fn)
        self._compute_s += dt
        return out

    def stretch(self, fn: Callable[[], T]) -> T:
        """Work a slower device also does slower but that is not forward/backward (the optimizer step)."""
        return self._run(fn)[0]


def emulation_timer(cluster: ClusterSpec | None, island: str, *, slowdown: float | None = None,
                    clock: Callable[[], float] | None = None, accelerator=None) -> EmulationTimer:
    """The timer of a rank on ``island``: the cluster's emulated slowdown of that island (1.0 when the
    cluster emulates nothing), unless ``slowdown`` is given (1.0 turns emulation off); timed by the
    ``accelerator``'s events when given (device events on GPUs). An island emulated on the "thread" clock
    (IslandEmulation.clock) is timed in the rank's thread CPU time with ``catch_up``, unless ``clock``
    is given."""
    emulated = cluster is not None and cluster.emulated
    if slowdown is None:
        slowdown = cluster.slowdown(island) if emulated else 1.0
    thread_clock = clock is None and emulated and cluster.emulation_clock(island) == "thread"
    timer = EmulationTimer(slowdown=slowdown, clock=time.thread_time if thread_clock else clock,
                           events=accelerator.event if accelerator is not None else None)
    timer.catch_up = thread_clock  # preemption on shared cores is repaid from the next waits (see catch_up)
    return timer
