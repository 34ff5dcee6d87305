"""An emulated slowdown on a GPU (train/timer.EmulationTimer with the accelerator's events) waits for the
device before it measures: the forward only launched kernels, and a host clock alone would stretch the
launch time instead of the compute. Checked with stand-in events whose synchronize takes the time."""

from __future__ import annotations

import time

import pytest

from megatron_het.train.timer import EmulationTimer


class _Event:
    log: list[str] = []

    def record(self):
        _Event.log.append("record")

    def synchronize(self):
        _Event.log.append("synchronize")
        time.sleep(0.05)  # the device finishing the launched work

    def elapsed_time(self, other):
        return 0.0


def test_emulation_waits_for_the_device_before_measuring():
    _Event.log = []
    timer = EmulationTimer(slowdown=2.0, events=_Event)
    timer.compute(lambda: None)  # launches nothing visible to the host: the 0.05 s is the device's
    assert _Event.log == ["record", "synchronize"]
    # compute (0.05 s) stretched 2x: ~0.1 s in all, not 2x a launch of microseconds
    assert timer.compute_s == pytest.approx(0.10, abs=0.04)
    assert timer.emulated_s == pytest.approx(0.05, abs=0.03)


def test_without_emulation_nothing_waits_for_the_device():
    _Event.log = []
    timer = EmulationTimer(slowdown=1.0, events=_Event)
    timer.stretch(lambda: None)  # the optimizer step: no synchronisation per iteration
    assert _Event.log == []
