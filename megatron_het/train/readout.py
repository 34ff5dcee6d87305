"""Step scalars (loss, gradient norm, loss scale) that stay on the device until a log interval reads them.

Reading a device tensor on the host (``.item()``, ``float()``) waits for every kernel queued before
it. Megatron-LM keeps each iteration's losses on the device and reads them once per
``--log-interval``; ``Readout`` does the same for the one trainer: a strategy's step hands over
device tensors, the trainer reads every pending readout of a log window with one host transfer
(``read_all``), and a value read earlier (e.g. by a test) is read on its own, correctly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["Readout", "read_all"]


class Readout:
    """Named scalars of one step: Python numbers, None, or one-element device tensors read later."""

    def __init__(self, **values: float | torch.Tensor | None) -> None:
        self._pending = {k: v.detach() for k, v in values.items() if isinstance(v, torch.Tensor)}
        self._values = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}

    def keys(self) -> list[str]:
        """Every name given, read or pending."""
        return [*self._values, *self._pending]

    @property
    def pending(self) -> bool:
        """True while some value still lives on the device (not read yet)."""
        return bool(self._pending)

    def get(self, key: str) -> float | None:
        """The value of ``key`` as a Python float (None stays None, as does a key never given); reads
        this readout if pending."""
        if key in self._pending:
            read_all([self])
        return self._values.get(key)

    def __getstate__(self) -> dict:  # pickled (gathered, returned by a spawned rank) as host numbers
        read_all([self])
        return {"_pending": {}, "_values": dict(self._values)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def read_all(readouts: Iterable[Readout]) -> int:
    """Read every pending value of ``readouts`` with one host transfer per device; returns the count."""
    by_device: dict[torch.device, list[tuple[Readout, str, torch.Tensor]]] = {}
    for r in readouts:
        for key, t in r._pending.items():
            by_device.setdefault(t.device, []).append((r, key, t))
    for entries in by_device.values():
        # float64 keeps every fp32/fp64 value exact; one cat + one tolist: one wait for the device
        flat = torch.cat([t.reshape(-1)[:1].to(torch.float64) for _, _, t in entries]).tolist()
        for (r, key, _), value in zip(entries, flat):
            r._values[key] = value
            del r._pending[key]
    return sum(len(e) for e in by_device.values())
