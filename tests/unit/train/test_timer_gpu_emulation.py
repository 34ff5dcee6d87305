"""An emulated slowdown on a GPU (train/timer.EmulationTimer with the accelerator's events) stretches the
device time of the action, measured between two events recorded around it: the forward only launched
kernels (a host clock would stretch the launches), and whatever the stream waited for before the start
event (a pipeline receive) is not compute (stretching it would inflate every bubble). Checked with
stand-in events on a simulated device clock."""

from __future__ import annotations

import pytest

from megatron_het.train.timer import EmulationTimer


class _Device:
    """A stream: ``busy_until`` is when its queued work ends; events stamp the stream's time."""

    now = 0.0
    log: list[str] = []


class _Event:
    def record(self):
        _Device.log.append("record")
        self.t = _Device.now

    def synchronize(self):
        _Device.log.append("synchronize")

    def elapsed_time(self, other):
        return (other.t - self.t) * 1000.0


def test_emulation_stretches_the_device_time_between_the_events_only():
    _Device.now, _Device.log = 1.0, []  # a receive made the stream wait until t = 1.0 before the action

    def forward():
        _Device.now += 0.02  # 20 ms of kernels

    timer = EmulationTimer(slowdown=2.0, events=_Event)
    timer.compute(forward)
    assert _Device.log == ["record", "record", "synchronize"]
    assert timer.compute_s == pytest.approx(0.04, abs=0.01)  # 20 ms stretched 2x, not the 1 s wait
    assert timer.emulated_s == pytest.approx(0.02, abs=0.01)


def test_without_emulation_nothing_waits_for_the_device():
    _Device.log = []
    timer = EmulationTimer(slowdown=1.0, events=_Event)
    timer.stretch(lambda: None)  # the optimizer step: no synchronisation per iteration
    assert _Device.log == []
