"""Measure this host's communication for a profile: gloo all-reduce and send/recv between local
processes, and the alpha-beta channel that fits them (used by ``tools/profile_host.py --comm-ranks``).

The fit is the model's own formula (perf/comm.py): a ring all-reduce over ``n`` ranks costs
``2(n-1) alpha + 2(n-1)/n S / B``, a send ``alpha + S / B``. Least squares in relative error
(each row divided by its measured time), so small and large messages weigh alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np

from megatron_het.perf.profile import MeasuredLink
from megatron_het.platform import detect_accelerator

__all__ = ["DEFAULT_SIZES", "fit_link", "measure_link"]

DEFAULT_SIZES = (4 * 1024, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024)  # bytes (fp32 buffers)


def fit_link(samples: Sequence[tuple[str, int, float]], *, ranks: int, method: str = "") -> MeasuredLink:
    """Alpha (latency) and bandwidth fitted to ``(op, bytes, seconds)`` samples over ``ranks``."""
    if ranks < 2:
        raise ValueError(f"ranks must be >= 2 to measure communication, got {ranks}")
    if len({b for _, b, _ in samples}) < 2:
        raise ValueError(f"need samples at >= 2 message sizes to fit latency and bandwidth, got {len(samples)} "
                         f"samples; measure more sizes")
    rows, rhs = [], []
    for op, nbytes, seconds in samples:
        if op == "all_reduce":
            a, b = 2 * (ranks - 1), 2 * (ranks - 1) / ranks * nbytes
        elif op == "send_recv":
            a, b = 1, nbytes
        else:
            raise ValueError(f"unknown operation {op!r}; expected all_reduce or send_recv")
        rows.append((a / seconds, b / seconds))
        rhs.append(1.0)
    (alpha, beta), *_ = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)
    alpha = max(float(alpha), 0.0)
    if not beta > 0:
        raise ValueError(f"measured times do not grow with message size (fitted 1/bandwidth {beta:.3g} s/byte); "
                         "re-measure on a quieter machine or with larger sizes")
    return MeasuredLink(ranks=ranks, latency_us=alpha * 1e6, bandwidth_gbps=8.0 / float(beta) / 1e9,
                        method=method or "least squares (relative) of the ring/p2p alpha-beta model",
                        samples=tuple((op, int(b), float(t)) for op, b, t in samples))


def _probe(rank: int, world_size: int, sizes: Sequence[int], repeats: int) -> list[tuple[str, int, float]]:
    import torch
    import torch.distributed as dist

    out = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=detect_accelerator().device)
        for op in ("all_reduce", "send_recv"):
            times = []
            for i in range(repeats + 2):  # two warm-ups
                dist.barrier()
                t0 = time.perf_counter()
                if op == "all_reduce":
                    dist.all_reduce(buf)
                elif rank == 0:  # a round trip between ranks 0 and 1 (two messages)
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                elif rank == 1:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                dt = time.perf_counter() - t0
                if i >= 2:
                    times.append(dt / 2 if op == "send_recv" else dt)
            out.append((op, nbytes, statistics.median(times)))
    return out


def measure_link(ranks: int = 2, *, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 10,
                 timeout_s: float = 600.0) -> MeasuredLink:
    """Spawn ``ranks`` local gloo processes (one thread each), measure, fit."""
    from megatron_het.platform.local_launch import run_local

    results = run_local(ranks, _probe, (tuple(sizes), repeats), timeout_s=timeout_s)
    samples = results[0]  # rank 0's clock; every rank waits for the slowest in a collective
    return fit_link(samples, ranks=ranks,
                    method=f"gloo over loopback, {ranks} local processes, median of {repeats}; least squares "
                           "(relative) of the ring/p2p alpha-beta model")
