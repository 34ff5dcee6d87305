"""Run a function on N local gloo processes standing in for N GPUs (tests, benchmarks, demos).

``torchrun`` is the production launcher; this is its in-Python twin for code that needs the
ranks' return values. Each child initialises ``torch.distributed`` on gloo over 127.0.0.1, runs
``fn(rank, world_size, *args)``, and sends back its return value or its traceback. A child that
dies or hangs becomes an error in the parent naming the rank, never a silent hang.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalLaunchError(RuntimeError):
    """A rank of a local launch failed or timed out."""


_START_METHOD = "spawn"


def preload_in_forkserver(modules: Sequence[str]) -> None:
    """Test-only hook: from now on, start ranks by forking a server that imported ``modules`` once.

    A spawned rank imports torch and megatron-core afresh (~7 s of CPU; an 8-rank launch on 2 cores
    spends ~30 s importing); a test session that launches hundreds of ranks pays that once here. A
    forked rank is given what a spawned one has: the launcher's current environment (``launcher_state``),
    working directory and ``sys.path`` (multiprocessing sends both), and freshly seeded generators.
    """
    global _START_METHOD
    mp.get_context("forkserver").set_forkserver_preload(list(modules))
    _START_METHOD = "forkserver"


def start_context():
    """The multiprocessing context ranks start from (spawn unless a test preloaded a fork server) and
    the launcher state a forked rank must adopt (``adopt_launcher_state``; None for spawn)."""
    return mp.get_context(_START_METHOD), (dict(os.environ) if _START_METHOD == "forkserver" else None)


def adopt_launcher_state(launcher_env: dict[str, str] | None) -> None:
    """In a rank forked from the fork server: the launcher's environment, and generators seeded from
    fresh entropy, as a spawned rank has them (all forks would share the server's states otherwise)."""
    if launcher_env is None:
        return
    import sys

    import torch

    os.environ.clear()
    os.environ.update(launcher_env)
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _child(fn, rank, world_size, port, args, queue, env, pg_timeout_s, launcher_env=None):
    adopt_launcher_state(launcher_env)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N processes share 2 cores: oversubscription only adds noise
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = fn(rank, world_size, *args)
        # Plain pickle copies tensor bytes; the queue's own reducer would share file descriptors
        # that vanish when this child exits.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report everything, including SystemExit from argparse
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(world_size: int, fn: Callable[..., Any], args: Sequence[Any] = (), *,
              timeout_s: float = 600.0, env: dict[str, str] | None = None,
              pg_timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes.

    ``fn`` must be importable by name (a module-level function). Returns the per-rank results in
    rank order. Raises ``LocalLaunchError`` with the failing rank's traceback.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx, launcher_env = start_context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, tuple(args), queue,
                                              dict(env or {}), pg_timeout_s, launcher_env), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise LocalLaunchError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in results and r not in errors]
                if dead:
                    r = dead[0]
                    raise LocalLaunchError(f"rank {r} died with exit code {procs[r].exitcode} "
                                           f"before reporting; other errors: {errors or 'none'}")
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                break  # the others will likely hang on a collective with the failed rank
        if errors:
            rank, tb = sorted(errors.items())[0]
            raise LocalLaunchError(f"rank {rank} failed:\n{tb}")
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
