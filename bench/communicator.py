"""Hierarchical vs flat all-reduce over an emulated slow inter-island link.

    python bench/communicator.py                  # 2x2, 2x4 and 4x2 (~8 min on 2 cores)
    python bench/communicator.py --islands 2x4    # one configuration (islands x ranks per island)

Islands are rank blocks of gloo processes; the intra-island link rate is measured per configuration
(every island all-reducing at once) and the inter-island link set SLOWDOWN (10x) slower, one egress pipe
per island, a rank sending over it sleeping its island's bytes / rate. Compared: the `het` group's
sharded hierarchical all-reduce, a flat gloo ring with islands in rank order, and the same ring
interleaved (rank r on island r % k); bytes over the slow link counted by the emulation and, apart, as
TCP bytes between ranks of different islands (`ss -ti`). Method, byte model and figures:
docs/communicator.md#benchmark.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from harness import RESULTS, max_over_ranks, stamp, write_result

from megatron_het.comm import IslandMembership, new_hierarchical_group
from megatron_het.platform.local_launch import run_local

CONFIGS = {"2x2": (2, 2), "2x4": (2, 4), "4x2": (4, 2)}  # name -> (islands k, ranks per island m)
SIZES_MIB = (1, 16, 64, 256)
SLOWDOWN = 10.0  # inter-island link is this many times slower than the intra-island one
CHUNK_BYTES = 4 << 20  # het all-reduce pipeline chunk
RATE_PROBE_MIB = 16  # tensor size of the intra-island rate measurement
OUT = RESULTS / "communicator.json"
METHODS = ("hierarchical", "flat_in_order", "flat_interleaved")


def placement(name: str, k: int, m: int) -> Callable[[int], int]:
    """rank -> island for a method (the hierarchical group uses the in-order islands)."""
    return (lambda r: r % k) if name == "flat_interleaved" else (lambda r: r // m)


def crossing_edges(island_of: Callable[[int], int], n: int) -> list[int]:
    """Ranks r whose ring edge r -> r+1 crosses an island boundary."""
    return [r for r in range(n) if island_of(r) != island_of((r + 1) % n)]


def flat_pipe_bytes(island_of: Callable[[int], int], n: int, size: int) -> dict[int, int]:
    """Per island: bytes a flat ring all-reduce of `size` bytes sends over its egress pipe."""
    per_edge = 2 * (n - 1) * size // n
    out: dict[int, int] = {}
    for r in crossing_edges(island_of, n):
        out[island_of(r)] = out.get(island_of(r), 0) + per_edge
    return out


def expected_bytes_ratio(method: str, k: int, m: int) -> float:
    """flat / hierarchical bytes over the slow link: crossing edges * (n-1) / (n (k-1))."""
    n = k * m
    return len(crossing_edges(placement(method, k, m), n)) * (n - 1) / (n * (k - 1))


# -- wire bytes: what the kernel's TCP sockets really sent between ranks -------------------------
def parse_ss(text: str) -> list[tuple[int, str, str, int]]:
    """(pid, local address, peer address, bytes_sent) per socket of `ss -tinpH` output."""
    rows, head = [], None
    for line in text.splitlines():
        if line and not line[0].isspace():  # socket line; its tcp_info follows, indented
            head = line.split()
            continue
        if head is None or len(head) < 5:
            continue
        pid = re.search(r"pid=(\d+)", " ".join(head[4:]))
        sent = re.search(r"bytes_sent:(\d+)", line)
        if pid:
            rows.append((int(pid.group(1)), head[2], head[3], int(sent.group(1)) if sent else 0))
        head = None
    return rows


def wire_matrix(table: list[tuple[int, str, str, int]], pids: list[int]) -> list[list[int]]:
    """bytes_sent[src rank][dst rank] summed over every socket between two ranks of this run.

    A socket's peer is found by the full address pair: Linux reuses an ephemeral local port for
    connections to different peers, so a local address alone can belong to several processes.
    """
    rank_of = {p: r for r, p in enumerate(pids)}
    owner = {(local, peer): rank_of[pid] for pid, local, peer, _ in table if pid in rank_of}
    out = [[0] * len(pids) for _ in pids]
    for pid, local, peer, sent in table:
        if pid in rank_of and (peer, local) in owner:
            out[rank_of[pid]][owner[(peer, local)]] += sent
    return out


def _read_wire(pids: list[int]) -> list[list[int]] | None:
    """The wire matrix now, or None where `ss` (iproute2) is missing."""
    if shutil.which("ss") is None:
        return None
    text = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True,
                          check=False).stdout
    return wire_matrix(parse_ss(text), pids)


def _wire_snapshot(rank: int, pids: list[int]) -> list[list[int]] | None:
    """Collective: every rank waits while rank 0 reads the socket table."""
    dist.barrier()
    snap = _read_wire(pids) if rank == 0 else None
    dist.barrier()
    return snap


def cross_island_bytes(delta: list[list[int]], island_of: Callable[[int], int]) -> int:
    n = len(delta)
    return sum(delta[a][b] for a in range(n) for b in range(n) if island_of(a) != island_of(b))


# -- the ranks ---------------------------------------------------------------------------------
def _intra_link_rate(rank: int, k: int, m: int) -> float:
    """Bytes/s on one intra-island ring edge, every island all-reducing at once; same on all ranks."""
    groups = [dist.new_group([i * m + j for j in range(m)]) for i in range(k)]
    mine = groups[rank // m]
    x = torch.ones(RATE_PROBE_MIB << 20 >> 2)
    dist.all_reduce(x, group=mine)
    start = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(x, group=mine)
    elapsed = max_over_ranks((time.perf_counter() - start) / 3)
    return 2 * (m - 1) / m * x.numel() * 4 / elapsed


def bench_rank(rank: int, world: int, k: int, m: int, sizes_mib: tuple[int, ...]) -> dict:
    n = k * m
    pids: list[int] = [0] * world
    dist.all_gather_object(pids, os.getpid())
    intra = _intra_link_rate(rank, k, m)
    inter = intra / SLOWDOWN
    membership = IslandMembership(rank_to_island={r: f"island{r // m}" for r in range(n)},
                                  island_backend={f"island{i}": ("nccl" if i % 2 else "gloo")
                                                  for i in range(k)})
    # the m shard holders of an island send at once through its one pipe: 1/m of its rate each
    het = new_hierarchical_group(list(range(n)), membership, link_bytes_per_s=inter / m,
                                 chunk_bytes=CHUNK_BYTES, timeout_s=600)

    def run(method: str, x: torch.Tensor) -> None:
        if method == "hierarchical":
            het.all_reduce(x)
            return
        island_of = placement(method, k, m)
        work = dist.all_reduce(x, async_op=True)
        if rank in crossing_edges(island_of, n):  # the pipe is shared: wait for all of its bytes
            time.sleep(flat_pipe_bytes(island_of, n, x.numel() * x.element_size())[island_of(rank)] / inter)
        work.wait()

    warm = torch.ones(1 << 18)
    for method in METHODS:  # gloo pairs, buffers and the het worker are set up outside the timing
        run(method, warm)
    check = torch.ones(1 << 10)
    het.all_reduce(check)
    if not torch.equal(check, torch.full_like(check, float(n))):
        raise RuntimeError(f"het all_reduce returned {check[:4].tolist()}, expected {n}")
    rows = []
    for mib in sizes_mib:
        x = torch.ones(mib << 20 >> 2)
        size = x.numel() * 4
        reps = 3 if mib <= 16 else 1
        row: dict = {"size_mib": mib, "reps": reps}
        for method in METHODS:
            before = het.bridge_bytes()
            wire0 = _wire_snapshot(rank, pids)
            start = time.perf_counter()
            for _ in range(reps):
                run(method, x)
            row[f"{method}_s"] = max_over_ranks((time.perf_counter() - start) / reps)
            wire1 = _wire_snapshot(rank, pids)
            if method == "hierarchical":
                sent = torch.tensor([(het.bridge_bytes() - before) // reps], dtype=torch.int64)
                dist.all_reduce(sent)
                row[f"{method}_model_bytes"] = int(sent)
                pipe = 2 * (k - 1) * size // k
            else:
                pipes = flat_pipe_bytes(placement(method, k, m), n, size)
                row[f"{method}_model_bytes"] = sum(pipes.values())
                pipe = max(pipes.values())
            row[f"{method}_link_bound_s"] = pipe / inter  # the slow link's time alone
            if wire0 is not None and wire1 is not None:
                delta = [[(b - a) // reps for a, b in zip(r0, r1)] for r0, r1 in zip(wire0, wire1)]
                row[f"{method}_wire_bytes"] = cross_island_bytes(delta, placement(method, k, m))
        for method in METHODS[1:]:
            row[f"speedup_vs_{method}"] = row[f"{method}_s"] / row["hierarchical_s"]
            row[f"model_bytes_ratio_vs_{method}"] = (row[f"{method}_model_bytes"]
                                                     / row["hierarchical_model_bytes"])
            if f"{method}_wire_bytes" in row:
                row[f"wire_bytes_ratio_vs_{method}"] = (row[f"{method}_wire_bytes"]
                                                        / row["hierarchical_wire_bytes"])
        rows.append(row)
    info = het.info
    het.close()
    return {"rows": rows, "intra_link_bytes_per_s": intra, "inter_link_bytes_per_s": inter,
            "implementation": info.implementation, "reason": info.reason}


# -- the driver --------------------------------------------------------------------------------
def run_config(name: str, sizes_mib: tuple[int, ...]) -> dict:
    k, m = CONFIGS[name]
    started = time.time()
    res = run_local(k * m, bench_rank, (k, m, sizes_mib), timeout_s=1800, pg_timeout_s=900)[0]
    return {"islands": f"{k} islands x {m} ranks (gloo, emulated)", "k": k, "m": m,
            "implementation": res["implementation"], "implementation_reason": res["reason"],
            "intra_island_link_bytes_per_s": round(res["intra_link_bytes_per_s"]),
            "inter_island_link_bytes_per_s": round(res["inter_link_bytes_per_s"]),
            "expected_bytes_ratio": {f"vs_{mt}": expected_bytes_ratio(mt, k, m) for mt in METHODS[1:]},
            "rows": res["rows"], "wall_s": round(time.time() - started, 1)}


def print_config(name: str, fig: dict) -> None:
    exp = fig["expected_bytes_ratio"]
    print(f"\n{name}: {fig['islands']}, {fig['implementation']}; intra-island link "
          f"{fig['intra_island_link_bytes_per_s'] / 1e6:.0f} MB/s, inter-island "
          f"{fig['inter_island_link_bytes_per_s'] / 1e6:.1f} MB/s ({SLOWDOWN:g}x slower); "
          f"expected bytes ratio: in order {exp['vs_flat_in_order']:.2f}, "
          f"interleaved {exp['vs_flat_interleaved']:.2f}")
    print(f"{'MiB':>4} {'hier s':>7} {'(link)':>7} {'flat s':>7} {'(link)':>7} {'flat-il s':>9} "
          f"{'x flat':>6} {'x il':>5} {'bytes/flat':>10} {'wire':>5} {'bytes/il':>8} {'wire':>5}")
    for r in fig["rows"]:
        wire = [r.get(f"wire_bytes_ratio_vs_{mt}") for mt in METHODS[1:]]
        wire_s = [f"{w:5.2f}" if w is not None else "  n/a" for w in wire]
        print(f"{r['size_mib']:>4} {r['hierarchical_s']:>7.2f} {r['hierarchical_link_bound_s']:>7.2f} "
              f"{r['flat_in_order_s']:>7.2f} {r['flat_in_order_link_bound_s']:>7.2f} "
              f"{r['flat_interleaved_s']:>9.2f} {r['speedup_vs_flat_in_order']:>6.2f} "
              f"{r['speedup_vs_flat_interleaved']:>5.2f} {r['model_bytes_ratio_vs_flat_in_order']:>10.2f} "
              f"{wire_s[0]} {r['model_bytes_ratio_vs_flat_interleaved']:>8.2f} {wire_s[1]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--islands", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS),
                        help="configurations, islands x ranks per island (default: all)")
    parser.add_argument("--sizes-mib", nargs="+", type=int, default=list(SIZES_MIB))
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    started = time.time()
    configs = {}
    for name in args.islands:
        configs[name] = run_config(name, tuple(args.sizes_mib))
        print_config(name, configs[name])
    targets = {"inter_island_bytes_reduction": "about the island size (m)",
               "speedup_vs_flat_at_10x_slower_link": ">= 1.5"}
    write_result(args.out, {
        "figures": {"configs": configs, "slowdown": SLOWDOWN, "chunk_bytes": CHUNK_BYTES,
                    "wall_s": round(time.time() - started, 1)},
        "targets": targets, **stamp(perf=False)})


if __name__ == "__main__":
    main()
