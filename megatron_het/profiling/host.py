"""A quick, cached profile of this host, and a plan priced from it (the figure ``make demo`` prints).

The CPU catalog entry is nominal (1 TFLOP/s, 50 GB/s): a CPU rank's time is set by the host, the
number of processes sharing its cores and per-operation overheads, so a CPU plan is priced from a
measurement of this host. :func:`host_profile` measures what the predictor reads for one model
shape (tools/profile_host.py's engine): the layers, the embedding and the output layer + loss, the
AdamW step per parameter, on ``min(ranks, cores)`` processes at once on the wall clock and on all
``ranks`` at once on the thread clock (one thread each; :func:`_concurrency`), and the links between
``ranks`` local gloo processes. The clock follows the cluster's emulation: on the
"thread" clock (IslandEmulation.clock) a rank's compute lasts its thread CPU time x slowdown, so the
profile is timed in thread CPU time too; on the "wall" clock in wall time, which is only right
while no more ranks compute at once than the host has cores (4 ranks on 2 cores under ZB-H1
measured 2.3x the profile: examples/clusters/cpu-demo-paced.yaml is the demo's answer). It is cached in a
JSON profile keyed by the host (processor, core count, torch version) and the shape, so the second
run costs nothing; ``refresh=True`` measures again.

    from megatron_het.profiling.host import predict_on_this_host
    result = predict_on_this_host(plan, model, cluster, cache_dir="runs/demo")
    print(f"predicted {result.iteration_time_s * 1e3:.0f} ms/iteration ({result.profile_path})")
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_het.cluster import ClusterSpec, ConfigError, ModelSpec
from megatron_het.perf.flops import padded_vocab_size
from megatron_het.perf.predict import SYNC_ALL_REDUCES_PER_ITERATION, Prediction, predict, small_all_reduce_s
from megatron_het.perf.profile import TRAINS_IN, Profile, load_profile, save_profile

__all__ = ["HostPrediction", "host_key", "host_profile", "predict_on_this_host"]

QUICK_REPEATS, QUICK_WARMUP = 9, 2


@dataclass(frozen=True)
class HostPrediction:
    """A plan's predicted iteration on this host and where its figures came from."""

    iteration_time_s: float  # predicted seconds per iteration
    prediction: Prediction  # the full prediction (stages, memory, ...; a sharded plan's own kind)
    profile: Profile  # the host profile it was priced from
    profile_path: str  # its cache file
    measured_now: bool  # False when the cached profile was reused


def _concurrency(ranks: int, clock: str = "wall") -> int:
    """Processes the profile is timed on at once. Wall clock: at most one per core (beyond that the
    times would count waiting for a core, which is not a property of the emulated device). Thread
    clock: every rank of the run, because the run's ranks share the cores the same way and their
    CPU time per layer grows with it (caches, switches): 10-12% on the demo's 4 ranks on 2 cores."""
    return max(1, ranks if clock == "thread" else min(ranks, os.cpu_count() or 1))


def host_key(model: ModelSpec, *, micro_batch_sizes: Sequence[int], ranks: int, threads: int,
             clock: str = "wall", precision: str = "fp32") -> str:
    """Cache key: this host (processor, cores, platform, torch) and what is measured."""
    import torch

    facts = {"processor": platform.processor() or platform.machine(), "cores": os.cpu_count(),
             "platform": platform.platform(), "torch": torch.__version__,
             "shape": [model.hidden_size, model.num_attention_heads, model.num_query_groups, model.ffn_hidden_size,
                       model.seq_length, padded_vocab_size(model.vocab_size), model.swiglu],
             "micro_batch_sizes": sorted(set(micro_batch_sizes)), "ranks": ranks, "threads": threads,
             "concurrent": _concurrency(ranks, clock), **({"clock": clock} if clock != "wall" else {}),
             **({"precision": precision} if precision != "fp32" else {})}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def host_profile(model: ModelSpec, *, micro_batch_sizes: Sequence[int], ranks: int, cache_dir: str | os.PathLike[str],
                 device: str = "CPU", threads: int = 1, clock: str = "wall", precision: str = "fp32",
                 refresh: bool = False) -> tuple[Profile, str, bool]:
    """(profile, its file, measured now?) for ``model``'s layer shape on this host, measured on
    ``_concurrency(ranks, clock)`` processes at once (one thread each) with links among ``ranks`` processes,
    timed on ``clock`` ("wall" or "thread": thread CPU time) in ``precision`` (the dtype the run's
    layers train in: "fp32", "bf16" or "fp16"); cached."""
    import torch

    from megatron_het.profiling.layers import CLOCKS, profile_concurrent, profile_layers
    from megatron_het.profiling.links import measure_link

    if ranks < 1 or threads < 1 or not micro_batch_sizes:
        raise ConfigError("needs ranks >= 1, threads >= 1 and at least one micro-batch size", field="ranks",
                          value=ranks, fix="pass the number of training ranks this host runs")
    if clock not in CLOCKS:  # checked before the cache is read: a cached file must not answer a bad clock
        raise ConfigError("unknown profile clock", field="clock", value=clock, fix=f"use one of {', '.join(CLOCKS)}")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if precision not in dtypes:
        raise ConfigError("a host profile is timed in fp32, bf16 or fp16", field="precision", value=precision,
                          fix="price the plan at one of those (tf32 plans train in fp32 here)")
    key = host_key(model, micro_batch_sizes=micro_batch_sizes, ranks=ranks, threads=threads, clock=clock,
                   precision=precision)
    path = Path(cache_dir) / f"host_profile_{key}.json"
    if path.exists() and not refresh:
        cached = load_profile(path)
        if cached.device == device:
            return cached, str(path), False
    options = dict(num_layers=2, micro_batch_sizes=sorted(set(micro_batch_sizes)), device=device,
                   warmup=QUICK_WARMUP, repeats=QUICK_REPEATS, dtype=dtypes[precision], implementation="auto",
                   vocab_size=padded_vocab_size(model.vocab_size), optimizer=True, clock=clock)
    concurrent = _concurrency(ranks, clock)
    if concurrent == 1:
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            profile = profile_layers(model, **options)
        finally:
            torch.set_num_threads(old)
    else:
        profile = profile_concurrent(model, processes=concurrent, **options)
    if ranks > 1:
        profile = replace(profile, link=measure_link(ranks))
    profile = replace(profile, method=profile.method + f"; quick host profile (megatron_het.profiling.host, key {key})")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, path)
    return replace(profile, source=str(path)), str(path), True


def predict_on_this_host(plan, model: ModelSpec, cluster: ClusterSpec, *, cache_dir: str | os.PathLike[str],
                         refresh: bool = False, threads: int = 1) -> HostPrediction:
    """Price ``plan`` (either plan kind) from a quick profile of this host, measured once and cached in
    ``cache_dir``. Every island must be of the one device type the profile stands for (a CPU cluster,
    emulated or not); links are measured among as many processes as the plan has ranks; compute is
    timed in thread CPU time when every island is emulated on the "thread" clock, else in wall time."""
    devices = {island.device.name for island in cluster.islands}
    if len(devices) != 1:
        raise ConfigError("a host profile prices one device type", field="cluster", value=sorted(devices),
                          fix="use a cluster whose islands all are of this host's device type (e.g. CPU)")
    from megatron_het.plan.sharded import ShardedPlan

    sharded = isinstance(plan, ShardedPlan)
    sizes = sorted({r.micro_batch_size for r in plan.ranks}) if sharded else [plan.micro_batch_size]
    thread_clock = all(cluster.emulation_clock(i.name) == "thread" for i in cluster.islands)  # "wall" unemulated
    # timed in the dtype the run trains in (runtime/plan_record.py: tf32 plans train in fp32 storage)
    precision = "fp32" if sharded else TRAINS_IN.get(plan.precision, plan.precision)
    profile, path, fresh = host_profile(model, micro_batch_sizes=sizes, ranks=plan.world_size,
                                        cache_dir=cache_dir, device=devices.pop(), threads=threads,
                                        clock="thread" if thread_clock else "wall", precision=precision,
                                        refresh=refresh)
    if sharded:
        from megatron_het.planner.sharded import predict_sharded

        pred = predict_sharded(plan, model, cluster, profile=profile)
        # the trainer's per-iteration all-reduces (grad norm, loss), which the pipeline predictor adds itself
        seconds = pred.iteration_time_s + SYNC_ALL_REDUCES_PER_ITERATION * small_all_reduce_s(
            cluster, plan.world_size, profile=profile)
    else:
        pred = predict(plan, model, cluster, profile=profile)
        seconds = pred.iteration_time_s
    return HostPrediction(iteration_time_s=seconds, prediction=pred, profile=profile, profile_path=path,
                          measured_now=fresh)
