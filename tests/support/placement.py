"""A trap for tensors and process groups the runtime creates outside the accelerator's choice.

``PlacementTrap`` (a ``TorchFunctionMode`` plus a wrapper of ``new_group``) records:

- every call of a torch factory function (``torch.empty``, ``zeros``, ``tensor``, ``arange``, ...)
  made *from megatron-het's runtime code* (runtime, sharding, resilience, comm, profiling, train,
  model) whose ``device=`` is missing or is not the accelerator's device object. The test passes a
  device object that is not the default device (``cpu:0``, not ``cpu``), so a missing ``device=``
  or a literal ``"cpu"`` are both caught on a CPU-only machine. ``Tensor.new_*`` and ``*_like``
  follow an existing tensor and are not factories of a new placement. The het bridge's host-staged
  copies (``comm/``) may also be on ``platform.HOST_DEVICE``: staging through the host is its design.
- every ``new_group`` (also the ones megatron-core's ``HyperCommGrid`` makes) whose backend is not
  one the accelerator chose (its island backend, its host backend for the bridge, or ``het``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_het"
SCOPED = ("runtime", "sharding", "resilience", "comm", "profiling", "train", "model")
HOST_STAGING = ("comm",)  # may stage through the host (the bridge)
# Functions that work on the host by design, by (file under the package, function name): the seeded
# initial values are drawn by CPU generators so every vendor draws the same bits, then copied once.
HOST_FUNCTIONS = {("runtime/initial_values.py", "local"), ("runtime/initial_values.py", "draw"),
                  ("runtime/grad_sync.py", "held_indices")}
FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.tensor, torch.arange, torch.rand,
             torch.randn, torch.randint, torch.empty_strided, torch.linspace, torch.eye, torch.as_tensor}


def _caller() -> tuple[str, int, str]:
    """The frame that called the factory (torch's own calls, e.g. inside ``all_gather_object``, are
    torch's placement, not the runtime's: they are attributed to torch and not judged)."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename == __file__:
        f = f.f_back
    return (f.f_code.co_filename, f.f_lineno, f.f_code.co_name) if f is not None else ("?", 0, "?")


def _package_of(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(PACKAGE)
    except ValueError:
        return None
    return rel.parts[0] if len(rel.parts) > 1 else None


def _relative(filename: str) -> str:
    return Path(filename).resolve().relative_to(PACKAGE).as_posix()


class PlacementTrap(TorchFunctionMode):
    """Use as a context manager around construction and a step; read ``violations`` after."""

    def __init__(self, accelerator) -> None:
        super().__init__()
        self.accelerator = accelerator
        self.violations: list[str] = []
        self.factory_calls = 0  # scoped factory calls seen (the trap saw the runtime at all)
        self.groups: list[str | None] = []  # backend of every new_group seen
        self._saved = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            filename, line, function = _caller()
            package = _package_of(filename)
            if package in SCOPED:
                self.factory_calls += 1
                device = kwargs.get("device")
                allowed = {self.accelerator.device}
                if package in HOST_STAGING or (_relative(filename), function) in HOST_FUNCTIONS:
                    from megatron_het.platform import HOST_DEVICE

                    allowed.add(HOST_DEVICE)
                if device is None or torch.device(device) not in allowed:
                    self.violations.append(f"{Path(filename).relative_to(PACKAGE.parent)}:{line}: "
                                           f"torch.{func.__name__}(device={device!r}), expected "
                                           f"{self.accelerator.device}")
        return func(*args, **kwargs)

    def _wrap_new_group(self, original):
        trap = self

        def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
            allowed = {trap.accelerator.torch_backend, trap.accelerator.host_backend, "het"}
            trap.groups.append(backend)
            if backend not in allowed:
                filename, line, function = _caller()
                trap.violations.append(f"{filename}:{line}: new_group(ranks={ranks}, backend={backend!r}), "
                                       f"the accelerator chose {sorted(allowed)}")
            return original(ranks, timeout, backend, *args, **kwargs)

        return new_group

    def __enter__(self):
        c10d = dist.distributed_c10d
        self._saved = (c10d.new_group, dist.new_group)
        wrapped = self._wrap_new_group(c10d.new_group)
        c10d.new_group = dist.new_group = wrapped
        return super().__enter__()

    def __exit__(self, *exc):
        c10d = dist.distributed_c10d
        c10d.new_group, dist.new_group = self._saved
        return super().__exit__(*exc)
