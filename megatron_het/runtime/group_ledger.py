"""The process groups one trainer created, so that it can destroy them when it is done.

torch keeps every group in its registry until ``destroy_process_group(group)``, and a gloo group keeps
its worker and transport threads (3 per group on CPU) and its connections as long as it is registered:
a process that builds trainer after trainer (benches, tests, a re-plan) otherwise accumulates them
(measured: 10 groups and ~30 threads per rank per trainer of bench/schedules.py's plans, all alive until
the process ends). The registry has no public listing; resilience (``recovery.abort_all_groups``) reads
the same map.
"""

from __future__ import annotations

import torch.distributed as dist


def live_groups() -> list:
    """Every process group torch has registered in this process (the world included); [] without one."""
    from torch.distributed import distributed_c10d as c10d

    return list(c10d._world.pg_map) if dist.is_initialized() else []


class GroupLedger:
    """Groups registered between ``GroupLedger()`` and ``seal()``: the owner's, destroyed by ``destroy()``.

    Construct it before the owner creates its groups and seal it after (groups created in between by
    anything else in this process would be counted as the owner's)."""

    def __init__(self) -> None:
        self._before = set(live_groups())  # what existed before the owner (the world, other trainers)
        self.groups: list = []  # the owner's groups, in creation order (filled by seal)

    def seal(self) -> None:
        self.groups = [g for g in live_groups() if g not in self._before]

    def destroy(self) -> None:
        """Destroy the owner's groups, newest first (local on gloo; every rank of them should call it, as
        with NCCL a group's shutdown may be collective). Idempotent."""
        live = set(live_groups())
        for g in reversed(self.groups):
            if g in live:
                dist.destroy_process_group(g)
        self.groups = []
