"""Tensor-parallel layer forward+backward with and without collective/GEMM overlap, on gloo.

    python bench/overlap.py            # ~2-4 min on 2 cores; writes bench/results/overlap.json

Two gloo ranks (TP=2, sequence parallelism), float32, one thread of compute per rank. Sizes are
calibrated at start so that the layer's collective and its GEMM take about the same time (the
case overlap helps most). Per repeat, interleaved so drift hits every variant alike:

* plain: ``chunks=1`` — Megatron's non-overlapped path (one collective, then one GEMM);
* overlap: ``chunks=4``, async collectives (megatron_het/comm/overlap.py);
* chunked-blocking: ``chunks=4``, blocking collectives (the cost of chunking alone).

Also measured alone: the collectives (comm_s) and the GEMMs (compute_s) of one forward+backward.
The model's prediction for the overlapped time is ``chunked_overlap_time(comm, compute, 4)``
(perf/axonn.py) per phase; exposed communication = time - compute_s. Medians over repeats; the
slowest rank counts in every sample.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_het.comm.overlap import all_gather_linear, linear_reduce_scatter  # noqa: E402
from megatron_het.perf.axonn import chunked_overlap_time  # noqa: E402
from megatron_het.platform.local_launch import run_local  # noqa: E402

WORLD = 2
CHUNKS = 4
REPEATS = int(os.environ.get("OVERLAP_BENCH_REPEATS", "7"))
SEQ, HIDDEN = 4096, 2048  # full sequence and hidden size; the shard is SEQ/2 rows
TARGET_SPEEDUP = 1.3
OUT = Path(__file__).resolve().parent / "results" / "overlap.json"


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return _max(time.perf_counter() - start)


def _median(fn, n: int = 3) -> float:
    return statistics.median(_timed(fn) for _ in range(n))


def _tensors(kind: str, width: int):
    """(x, w, dy) of one rank. column: x is the sequence shard, w the [width, HIDDEN] slice, dy the
    full sequence; row: x is the full sequence of width input features, dy this rank's shard."""
    if kind == "column":
        return torch.randn(SEQ // WORLD, HIDDEN), torch.randn(width, HIDDEN), torch.randn(SEQ, width)
    return torch.randn(SEQ, width), torch.randn(HIDDEN, width), torch.randn(SEQ // WORLD, HIDDEN)


def _calibrate_width(kind: str) -> int:
    """Width whose three GEMMs take as long as the layer's two collectives (communication does not
    depend on the width, compute is proportional to it)."""
    trial = 256
    comm, compute = _parts(kind, *_tensors(kind, trial))
    c, g = _median(comm), _median(compute)
    t = torch.tensor([max(16, min(8192, int(trial * c / max(g, 1e-6)) // 8 * 8))], dtype=torch.int64)
    dist.broadcast(t, src=0)  # every rank must use the same width
    return int(t)


def _layer_step(kind: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, chunks: int, overlap: bool):
    def step():
        xi = x.detach().requires_grad_(True)
        wi = w.detach().requires_grad_(True)
        fn = all_gather_linear if kind == "column" else linear_reduce_scatter
        fn(xi, wi, chunks=chunks, overlap=overlap).backward(dy)

    return step


def _parts(kind: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    """(comm-only, compute-only) callables for one forward+backward of the plain layer."""
    if kind == "column":  # forward: all-gather x; backward: reduce-scatter dX
        gathered = torch.empty(SEQ, *x.shape[1:])
        dx_full = torch.empty_like(gathered)
        dx = torch.empty_like(x)

        def comm():
            dist.all_gather_into_tensor(gathered, x)
            dist.reduce_scatter_tensor(dx, dx_full)

        def compute():
            gathered @ w.t()
            dy @ w
            dy.reshape(-1, dy.shape[-1]).t() @ gathered.reshape(-1, gathered.shape[-1])
    else:  # forward: reduce-scatter y; backward: all-gather dY
        y_full = torch.empty(SEQ, w.shape[0])
        y = torch.empty(SEQ // WORLD, w.shape[0])
        dy_full = torch.empty(SEQ, w.shape[0])

        def comm():
            dist.reduce_scatter_tensor(y, y_full)
            dist.all_gather_into_tensor(dy_full, dy)

        def compute():
            x @ w.t()
            dy_full @ w
            dy_full.t() @ x
    return comm, compute


def bench_rank(rank: int, world: int) -> dict:
    torch.manual_seed(rank)
    cases = {}
    for kind in ("column", "row"):
        width = _calibrate_width(kind)
        x, w, dy = _tensors(kind, width)
        variants = {"plain": (1, True), "overlap": (CHUNKS, True), "chunked_blocking": (CHUNKS, False)}
        steps = {name: _layer_step(kind, x, w, dy, c, o) for name, (c, o) in variants.items()}
        comm, compute = _parts(kind, x, w, dy)
        samples: dict[str, list[float]] = {name: [] for name in (*steps, "comm", "compute")}
        for fn in steps.values():  # warm-up
            _timed(fn)
        for _ in range(REPEATS):
            for name, fn in steps.items():
                samples[name].append(_timed(fn))
            samples["comm"].append(_timed(comm))
            samples["compute"].append(_timed(compute))
        cases[kind] = {name: statistics.median(v) for name, v in samples.items()}
        cases[kind].update(samples=samples, width=width)
    return {"cases": cases}


def _figures(res: dict) -> dict:
    out = {"seq": SEQ, "hidden": HIDDEN, "tp": WORLD, "chunks": CHUNKS,
           "repeats": REPEATS, "layers": {}}
    for kind, m in res["cases"].items():
        predicted = chunked_overlap_time(m["comm"], m["compute"], CHUNKS)
        out["layers"][kind] = {
            "width": m["width"], "samples_s": m["samples"],
            "plain_s": m["plain"], "overlap_s": m["overlap"], "chunked_blocking_s": m["chunked_blocking"],
            "comm_alone_s": m["comm"], "compute_alone_s": m["compute"],
            "speedup": m["plain"] / m["overlap"],
            "measured_exposed_comm_s": {"plain": m["plain"] - m["compute"], "overlap": m["overlap"] - m["compute"]},
            "predicted_overlap_s": predicted,
            "predicted_exposed_comm_s": {"plain": m["comm"], "overlap": predicted - m["compute"]},
        }
    return out


def main() -> None:
    start = time.time()
    res = run_local(WORLD, bench_rank, timeout_s=1800)[0]
    figures = _figures(res)
    widths = ", ".join(f"{k} {f['width']}" for k, f in figures["layers"].items())
    print(f"TP={WORLD} gloo, seq={SEQ}, hidden={HIDDEN}, calibrated widths: {widths}, "
          f"chunks={CHUNKS}, {REPEATS} repeats (medians, seconds, forward+backward)")
    head = f"{'layer':<7} {'plain':>8} {'overlap':>8} {'chunk-blk':>9} {'comm':>8} {'compute':>8} " \
           f"{'speedup':>8} {'exp.meas':>9} {'exp.pred':>9}"
    print(head)
    for kind, f in figures["layers"].items():
        print(f"{kind:<7} {f['plain_s']:8.4f} {f['overlap_s']:8.4f} {f['chunked_blocking_s']:9.4f} "
              f"{f['comm_alone_s']:8.4f} {f['compute_alone_s']:8.4f} {f['speedup']:8.2f} "
              f"{f['measured_exposed_comm_s']['overlap']:9.4f} {f['predicted_exposed_comm_s']['overlap']:9.4f}")
    met = all(f["speedup"] >= TARGET_SPEEDUP for f in figures["layers"].values())
    print(f"target speedup >= {TARGET_SPEEDUP}: {'met' if met else 'NOT met'} ({time.time() - start:.0f} s)")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "figures": figures,
        "targets": {"speedup_min": TARGET_SPEEDUP, "met": met},
        "command": "python bench/overlap.py",
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "torch": torch.__version__,
                    "load_average_at_end": os.getloadavg()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
