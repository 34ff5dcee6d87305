"""Hierarchical vs flat all-reduce over an emulated slow inter-island link.

    python bench/communicator.py            # ~1-3 min on 2 cores; writes bench/results/communicator.json

Emulation (CPU only, no tc/netem): 4 gloo ranks form 2 islands of 2. The intra-island "link" is
loopback gloo; its all-reduce rate is measured first, and the inter-island link is set 10x slower.
The slow link is one shared pipe per direction between the islands: a rank that sends B bytes
over it sleeps B_link / rate, where B_link is everything that crosses in that direction.
- hierarchical: the `het` group's leaders sleep inside the bridge before each chunk's exchange
  (link_bytes_per_s), serially, so the emulated cost is never hidden behind the gloo copy.
- flat: a world gloo all-reduce runs while every rank whose ring edge crosses islands sleeps the
  link time concurrently (elapsed = max of the two, the kindest model for flat). Bytes are those a
  ring all-reduce sends over island-crossing edges: 2(n-1)/n * S per crossing edge. Two rank
  placements: islands in rank order (2 crossing edges) and interleaved (every edge crosses).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_het.comm import IslandMembership, new_hierarchical_group  # noqa: E402
from megatron_het.platform.local_launch import run_local  # noqa: E402

WORLD = 4
SIZES_MIB = (1, 16, 64, 256)
SLOWDOWN = 10.0  # inter-island link is this many times slower than the intra-island one
OUT = Path(__file__).resolve().parent / "results" / "communicator.json"
PLACEMENTS = {"in_order": lambda r: r // 2, "interleaved": lambda r: r % 2}  # rank -> island


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _link_bytes(island_of, size_bytes: int) -> dict[int, int]:
    """Per sending rank: bytes on its (shared, directional) inter-island link in a flat ring."""
    per_edge = 2 * (WORLD - 1) * size_bytes // WORLD
    crossing = [r for r in range(WORLD) if island_of(r) != island_of((r + 1) % WORLD)]
    by_direction: dict[tuple[int, int], int] = {}
    for r in crossing:
        key = (island_of(r), island_of((r + 1) % WORLD))
        by_direction[key] = by_direction.get(key, 0) + per_edge
    return {r: by_direction[(island_of(r), island_of((r + 1) % WORLD))] for r in crossing}


def _intra_rate(rank: int) -> float:
    """Measured intra-island all-reduce rate (bytes/s of payload), agreed on by all ranks."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    x = torch.ones(16 << 20 >> 2)
    dist.all_reduce(x, group=groups[rank // 2])
    start = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(x, group=groups[rank // 2])
    elapsed = _max((time.perf_counter() - start) / 3)
    return x.numel() * 4 / elapsed


def bench_rank(rank: int, world: int) -> dict:
    intra = _intra_rate(rank)
    inter = intra / SLOWDOWN
    membership = IslandMembership(rank_to_island={r: f"island{r // 2}" for r in range(world)},
                                  island_backend={"island0": "gloo", "island1": "nccl"})
    het = new_hierarchical_group(list(range(world)), membership, link_bytes_per_s=inter,
                                 chunk_bytes=4 << 20, timeout_s=300)
    rows = []
    for mib in SIZES_MIB:
        x = torch.ones(mib << 20 >> 2)
        reps = 1 if mib >= 64 else 3
        het.all_reduce(x)  # warm-up (also warms the gloo pairs)
        before = het.bridge_bytes()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            het.all_reduce(x)
        t_hier = _max((time.perf_counter() - start) / reps)
        hier_bytes = torch.tensor([(het.bridge_bytes() - before) // reps], dtype=torch.int64)
        dist.all_reduce(hier_bytes)
        row = {"size_mib": mib, "hierarchical_s": t_hier, "hierarchical_link_bytes": int(hier_bytes)}
        for name, island_of in PLACEMENTS.items():
            link = _link_bytes(island_of, x.numel() * 4)
            dist.all_reduce(x)  # warm-up
            dist.barrier()
            start = time.perf_counter()
            for _ in range(reps):
                work = dist.all_reduce(x, async_op=True)
                if rank in link:
                    time.sleep(link[rank] / inter)
                work.wait()
            row[f"flat_{name}_s"] = _max((time.perf_counter() - start) / reps)
            # every crossing edge's bytes, summed over both directions
            row[f"flat_{name}_link_bytes"] = 2 * (WORLD - 1) * x.numel() * 4 // WORLD * len(link)
            row[f"speedup_vs_flat_{name}"] = row[f"flat_{name}_s"] / t_hier
            row[f"bytes_ratio_vs_flat_{name}"] = row[f"flat_{name}_link_bytes"] / row["hierarchical_link_bytes"]
        rows.append(row)
    info = het.info
    het.close()
    return {"rows": rows, "intra_bytes_per_s": intra, "inter_bytes_per_s": inter,
            "implementation": info.implementation, "reason": info.reason}


def main() -> None:
    started = time.time()
    res = run_local(WORLD, bench_rank, (), timeout_s=900, pg_timeout_s=600)[0]
    figures = {"islands": "2 islands x 2 ranks (gloo, emulated)", "implementation": res["implementation"],
               "implementation_reason": res["reason"],
               "intra_island_allreduce_bytes_per_s": round(res["intra_bytes_per_s"]),
               "inter_island_link_bytes_per_s": round(res["inter_bytes_per_s"]),
               "rows": res["rows"], "wall_s": round(time.time() - started, 1)}
    targets = {"inter_island_bytes_reduction": "about the island size (2)",
               "speedup_vs_flat_at_10x_slower_link": ">= 1.5"}
    print(f"implementation: {res['implementation']} ({res['reason']})")
    print(f"intra-island rate {res['intra_bytes_per_s'] / 1e6:.0f} MB/s, inter-island link "
          f"{res['inter_bytes_per_s'] / 1e6:.0f} MB/s (emulated, {SLOWDOWN:g}x slower)")
    print(f"{'MiB':>5} {'hier s':>8} {'flat s':>8} {'flat-il s':>9} {'x flat':>7} {'x flat-il':>9} "
          f"{'bytes/flat':>10} {'bytes/flat-il':>13}")
    for r in res["rows"]:
        print(f"{r['size_mib']:>5} {r['hierarchical_s']:>8.3f} {r['flat_in_order_s']:>8.3f} "
              f"{r['flat_interleaved_s']:>9.3f} {r['speedup_vs_flat_in_order']:>7.2f} "
              f"{r['speedup_vs_flat_interleaved']:>9.2f} {r['bytes_ratio_vs_flat_in_order']:>10.2f} "
              f"{r['bytes_ratio_vs_flat_interleaved']:>13.2f}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "figures": figures, "targets": targets, "command": "python bench/communicator.py",
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "platform": platform.platform()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
