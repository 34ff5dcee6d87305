"""Local launcher for resilience runs: the rendezvous store lives in the launcher, ranks may die.

``platform.local_launch.run_local`` treats a dead rank as an error of the whole run; here a rank
killed on purpose is an expected outcome, and the TCP store (heartbeats, agreement, every
generation's process-group rendezvous) is hosted by this parent process so that it survives any
rank. ``fn(rank, world_size, store_address, *args)`` must be a module-level function.

The store listens on one interface only, ``host`` (loopback by default: every rank of a local run is
on this machine); torch's TCPStore would listen on all of them, unauthenticated, so the launcher
binds the listening socket itself and hands it over (``serve_store``).

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
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_het.platform.local_launch import LocalLaunchError, adopt_launcher_state, start_context
from megatron_het.resilience.agreement import StoreAddress

LOOPBACK = "127.0.0.1"  # where a single-machine run's store listens


@dataclass(frozen=True, kw_only=True)
class RankOutcome:
    """How one rank ended."""

    rank: int  # original rank
    status: str  # "ok" (returned), "died" (killed / exited without reporting)
    result: Any = None  # fn's return value when ok
    exitcode: int | None = None  # process exit code (-9 for SIGKILL)


def _child(fn, rank, world_size, address, args, queue, pg_timeout_s, launcher_env=None):
    os.setpgid(0, 0)  # this rank and everything it starts: one group the launcher can kill
    adopt_launcher_state(launcher_env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    try:
        store = address.connect()
        from megatron_het.platform import detect_accelerator

        dist.init_process_group(detect_accelerator().world_backend, store=dist.PrefixStore("gen0/", store),
                                rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = fn(rank, world_size, address, *args)
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def serve_store(host: str = LOOPBACK, port: int = 0, *, timeout_s: float = 60.0) -> tuple[dist.TCPStore, StoreAddress]:
    """A TCPStore server listening on ``host`` only (port 0: any free port), and its address.

    torch's TCPStore binds its server to every interface whatever host name it is given; it does
    accept an already listening socket (``master_listen_fd``), so the socket is bound here to the
    one address asked for and passed in (the store owns it from then on).
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.fileno(),
                              timeout=datetime.timedelta(seconds=timeout_s))
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server closes the descriptor when it stops
    return store, StoreAddress(host=host, port=port)


def run_resilient_local(world_size: int, fn: Callable[..., Any], args: Sequence[Any] = (), *,
                        timeout_s: float = 900.0, pg_timeout_s: float = 15.0,
                        host: str = LOOPBACK) -> list[RankOutcome]:
    """Spawn ``world_size`` gloo ranks around a store hosted here; return every rank's outcome.

    The store listens on ``host`` only (loopback unless ranks on other machines must reach it).
    Raises LocalLaunchError when a rank raises, or when ranks are still running at ``timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1 (got {world_size}). Fix: launch at least one rank")
    store, address = serve_store(host)
    ctx, launcher_env = start_context()
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, address, tuple(args), q, pg_timeout_s, launcher_env))
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
