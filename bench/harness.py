"""What the benches share: the results file each writes, ranks computing on this CPU, emulated devices
timed in thread CPU time, and the four-stage cluster the schedule benches (bench/schedules*.py) measure.

Imported by the scripts in this folder as ``harness`` (Python puts a script's own folder first on its
path, so no set-up is needed). Results files are written through the project's one atomic writer.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from megatron_het.cluster import ModelSpec
from megatron_het.plan import Plan, ReplicaPlan, StagePlan, uneven_chunk_layers
from megatron_het.utils.atomic import write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


# -- the results file ---------------------------------------------------------------------------------

def machine() -> dict:
    """This host as a results file records it (the machines are shared: the load matters)."""
    import torch

    return {"cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "load_average": list(os.getloadavg())}


def perf_commit() -> str:
    """Which commit of megatron_het/perf this run imported: the most recent of the last ten perf
    commits whose files match the imported package, else the last one + "uncommitted changes"
    (predictions depend on the performance model, which changes between commits)."""
    import megatron_het.perf as perf_pkg

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout

    here = Path(perf_pkg.__file__).parent
    mine = {f.name: f.read_text() for f in here.glob("*.py")}
    commits = git("log", "-10", "--format=%h", "--", "megatron_het/perf").split()
    for commit in commits:
        files = git("ls-tree", "--name-only", commit, "megatron_het/perf/").split()
        theirs = {Path(p).name: git("show", f"{commit}:{p}") for p in files if p.endswith(".py")}
        if theirs == mine:
            return f"{commit} (as committed)"
    return f"{commits[0] if commits else '?'} + uncommitted changes"


def stamp(*, perf: bool = True, load_before=None, load_after=None) -> dict:
    """What a results file carries beside its figures: ``command`` (as this run was started), ``machine``,
    ``perf_commit`` (unless ``perf`` is False), ``date`` (UTC); with ``load_before``, the load before and after."""
    out = {"command": " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]), "machine": machine()}
    if perf:
        out["perf_commit"] = perf_commit()
    if load_before is not None:
        out["load_average_before"] = load_before
        out["load_average_after"] = os.getloadavg() if load_after is None else load_after
    out["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return out


def write_result(name: str | Path, payload: dict) -> Path:
    """``bench/results/NAME`` (or the path ``name``; atomic), indented JSON with a trailing newline."""
    path = RESULTS / name
    write_text_atomic(path, json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {os.path.relpath(path)}")
    return path


# -- ranks on this CPU ----------------------------------------------------------------------------------

def cpu_rank(threads: int | None = 1) -> None:
    """A rank computing on this CPU: ``threads`` torch threads (None: torch's default), megatron-core's CPU backend."""
    import torch

    from megatron_het.platform import enable_cpu_backend

    if threads:
        torch.set_num_threads(threads)
    enable_cpu_backend()


def synthetic_batches(model: ModelSpec, seed: int = 1):
    """``batch_fn(iteration, indices)``: synthetic token batches of ``model``'s shape, the same on every rank."""
    from megatron_het.data.synthetic import synthetic_batch

    def batch_fn(iteration, indices):
        return synthetic_batch(seed=seed, iteration=iteration, indices=indices, seq_length=model.seq_length,
                               vocab_size=model.vocab_size)

    return batch_fn


def slowest(per_rank) -> list[float]:
    """Per iteration, the slowest rank's time (``per_rank``: each rank's times, iterations in one order)."""
    return [max(times) for times in zip(*per_rank)]


def max_over_ranks(value: float) -> float:
    """``value``'s maximum over the ranks of the default group (a collective: every rank calls it)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def alternating(names, round_index: int) -> list:
    """``names`` in order in even rounds, reversed in odd ones (drift between rounds hits every case alike)."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


# -- emulated devices, timed in thread CPU time ------------------------------------------------------

def thread_clock_trainer(model: ModelSpec, plan: Plan, train, batch_fn, cluster=None, *, catch_up: bool = False,
                         **kw):
    """A HeteroTrainer whose emulated devices stretch each compute call's *thread CPU time* by the island's
    slowdown (sleeping the rest), so ranks sharing cores keep their emulated speeds whatever the other
    processes do. ``catch_up``: host lag (the rank preempted mid-action, a sleep woken late) is repaid from
    the rank's next sleeps instead of the emulated device running slower."""
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    trainer = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn, cluster=cluster,
                            clock=time.thread_time, **kw)
    trainer.timer.catch_up = catch_up
    return trainer


def count_compute(timer, record) -> None:
    """Wrap ``timer.compute``: after each call, ``record(thread CPU s, involuntary context switches)`` of
    that call (what the emulation stretches, and how often the rank was preempted inside it)."""
    timed = timer.compute

    def compute(fn):
        switches, cpu = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw, time.thread_time()
        try:
            return timed(fn)
        finally:
            record(time.thread_time() - cpu, resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw - switches)

    timer.compute = compute


def per_iteration(calls: list[tuple[float, int]], logs, first: int = 1) -> list[tuple[float, int, int, float]]:
    """(compute CPU s, compute calls, involuntary switches, elapsed s) of each iteration from ``first`` on, from
    ``count_compute``'s (CPU s, switches) per call (as many each iteration) and the trainer's iteration logs."""
    n = len(calls) // len(logs)
    return [(sum(c for c, _ in calls[i * n:(i + 1) * n]), n, sum(s for _, s in calls[i * n:(i + 1) * n]),
             logs[i].elapsed_s) for i in range(first, len(logs))]


def on_actions(executor, hook) -> list[int]:
    """Have ``executor`` call ``hook(i, action)`` as it reaches each action (before the on_action its caller
    passes); returns ``[n]``: how many of its runs (one per iteration) have started."""
    run, runs = executor.run, [0]

    def hooked(**kw):
        user = kw.get("on_action")

        def both(i, action):
            hook(i, action)
            if user is not None:
                user(i, action)

        kw["on_action"] = both
        runs[0] += 1
        return run(**kw)

    executor.run = hooked
    return runs


# -- the schedule benches' cluster (bench/schedules*.py) ---------------------------------------------
# 4 pipeline stages, one rank each: three on island ``fast``, the last on ``slow``, emulated 2x slower than
# ``fast``. Four ranks share this 2-core machine, so both islands are emulated slower than the host (fast 4x,
# slow 8x) on the thread CPU clock. Layers follow the speeds (4/4/4/2 of 14; interleaved: chunks of 2/2/2/1).

MODEL = ModelSpec(num_layers=14, hidden_size=256, num_attention_heads=8, seq_length=64, vocab_size=1000)
MICRO_BATCH, MICRO_BATCHES, WARMUP = 2, 8, 2
FAST, SLOW = 4.0, 8.0  # emulated slowdown of the islands relative to this host's core (slow = 2x fast)
CLUSTER = {
    "islands": [{"name": "fast", "device": "CPU", "nodes": 1, "gpus_per_node": 3},
                {"name": "slow", "device": "CPU", "nodes": 1, "gpus_per_node": 1}],
    "links": [{"between": ["fast", "slow"], "bandwidth_gbps": 10, "latency_us": 50}],
    "emulation": {"fast": {"slowdown": FAST}, "slow": {"slowdown": SLOW}},
}
SCHEDULES = ("1f1b", "interleaved", "zb-h1")
PROFILE = RESULTS / "schedules_profile.json"
SWEEP_MIB = 64  # swept through the caches before each profiled repetition: 2x this host's 32 MiB L3


def plans() -> dict[str, Plan]:
    """The same 4-stage layout under each schedule (interleaved: 2 chunks per stage, uneven like the stages)."""
    islands = ("fast", "fast", "fast", "slow")
    layers = ((0, 4), (4, 8), (8, 12), (12, 14))
    chunks = uneven_chunk_layers([[2, 2], [2, 2], [2, 2], [1, 1]])

    def plan(schedule: str) -> Plan:
        v = 2 if schedule == "interleaved" else 1
        stages = tuple(StagePlan(island=islands[s], device_type="CPU", ranks=(s,), layers=layers[s],
                                 chunk_layers=chunks[s] if v > 1 else ()) for s in range(4))
        return Plan(replicas=(ReplicaPlan(stages=stages, num_micro_batches=MICRO_BATCHES),),
                    micro_batch_size=MICRO_BATCH, global_batch_size=MICRO_BATCH * MICRO_BATCHES,
                    schedule=schedule, virtual_pipeline_size=v, precision="fp32")

    return {s: plan(s) for s in SCHEDULES}


def rank_setup(iters: int, *, model: ModelSpec = MODEL, cluster: dict = CLUSTER):
    """A schedule bench's rank: one torch thread, the CPU backend; (the ClusterSpec of ``cluster``, a TrainConfig
    of ``iters`` iterations of these plans' batch, the synthetic ``batch_fn`` of ``model``'s shape)."""
    from megatron_het.cluster import cluster_from_dict
    from megatron_het.train.config import TrainConfig

    cpu_rank()
    train = TrainConfig(micro_batch_size=MICRO_BATCH, global_batch_size=MICRO_BATCH * MICRO_BATCHES,
                        train_iters=iters, lr=1e-4, log_interval=iters)
    return cluster_from_dict(cluster), train, synthetic_batches(model)


def schedule_trainers(order, iters: int, *, catch_up: bool = False):
    """This rank's trainer of each plan in ``order`` in turn, as (name, trainer), after ``rank_setup``: each
    built when the previous one is done with (emulated on the thread CPU clock, ``catch_up`` as given)."""
    cluster, train, batch_fn = rank_setup(iters)
    for name in order:
        yield name, thread_clock_trainer(MODEL, plans()[name], train, batch_fn, cluster, catch_up=catch_up)
