"""Local launcher for resilience runs: the rendezvous store lives in the launcher, ranks may die.

``platform.local_launch.run_local`` treats a dead rank as an error of the whole run; here a rank
killed on purpose is an expected outcome, and the TCP store (heartbeats, agreement, every
generation's process-group rendezvous) is hosted by this parent process so that it survives any
rank. ``fn(rank, world_size, store_address, *args)`` must be a module-level function.

Each rank leads its own process group, and the launcher kills every group at the end: a rank that
was SIGKILLed cannot stop the helpers it started (megatron's checkpoint writer starts a
multiprocessing manager on the first save), which would otherwise outlive the run as orphans.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_het.platform.local_launch import LocalLaunchError, free_port
from megatron_het.resilience.agreement import StoreAddress


@dataclass(frozen=True, kw_only=True)
class RankOutcome:
    """How one rank ended."""

    rank: int  # original rank
    status: str  # "ok" (returned), "died" (killed / exited without reporting)
    result: Any = None  # fn's return value when ok
    exitcode: int | None = None  # process exit code (-9 for SIGKILL)


def _child(fn, rank, world_size, address, args, queue, pg_timeout_s):
    os.setpgid(0, 0)  # this rank and everything it starts: one group the launcher can kill
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    try:
        store = address.connect()
        dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", store), rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = fn(rank, world_size, address, *args)
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_resilient_local(world_size: int, fn: Callable[..., Any], args: Sequence[Any] = (), *,
                        timeout_s: float = 900.0, pg_timeout_s: float = 15.0) -> list[RankOutcome]:
    """Spawn ``world_size`` gloo ranks around a store hosted here; return every rank's outcome.

    Raises LocalLaunchError when a rank raises, or when ranks are still running at ``timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1 (got {world_size}). Fix: launch at least one rank")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    address = StoreAddress(host="127.0.0.1", port=port)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, address, tuple(args), q, pg_timeout_s))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, RankOutcome] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world_size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise LocalLaunchError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
            try:
                rank, status, payload = q.get(timeout=0.5)
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if r not in outcomes and p.exitcode not in (None, 0):
                        outcomes[r] = RankOutcome(rank=r, status="died", exitcode=p.exitcode)
                continue
            if status == "error":
                raise LocalLaunchError(f"rank {rank} failed:\n{payload}")
            outcomes[rank] = RankOutcome(rank=rank, status="ok", result=pickle.loads(payload), exitcode=0)
        return [outcomes[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
            kill_group(p.pid)
        del store


def kill_group(pgid: int | None) -> None:
    """SIGKILL what is left of a rank's process group (its orphaned helpers); no-op when empty."""
    if pgid is None:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
