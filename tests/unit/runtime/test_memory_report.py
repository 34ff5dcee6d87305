"""The saved-activation count of runtime/memory_report.MemoryProbe: storages counted once, live from
pack until autograd releases them, parameters excluded; checked against hand-computed byte counts."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_het.runtime.memory_report import MemoryProbe


def _trainer(params):
    return SimpleNamespace(strategy=SimpleNamespace(params=params))


def test_saved_tensors_are_counted_once_per_storage_and_released_by_backward():
    w = torch.nn.Parameter(torch.randn(100, 100))
    trainer = _trainer({"w": w})
    probe = MemoryProbe()
    probe.on_step_start(trainer, 0)
    probe.on_action(trainer, 0, 0, SimpleNamespace(kind="F"))
    x = torch.randn(10, 100, requires_grad=True)
    y = x @ w  # saves x (4000 B) and w (a parameter: not an activation)
    z = y.exp()  # saves its output (4000 B)
    loss = (z * z).sum()  # saves z twice: the same storage, counted once
    probe.on_action(trainer, 0, 1, SimpleNamespace(kind="B"))
    assert probe._live_bytes == 4000 + 4000
    loss.backward()
    del loss, z, y
    probe.on_step_end(trainer, None)
    assert probe.peak_bytes == 8000
    assert probe._live_bytes == 0  # everything released by the backward
    assert probe.per_microbatch_bytes == 8000  # what the forward action left saved
