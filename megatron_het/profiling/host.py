"""A quick, cached profile of this host, and a plan priced from it (the figure ``make demo`` prints).

The CPU catalog entry is nominal (1 TFLOP/s, 50 GB/s): a CPU rank's time is set by the host, the
number of processes sharing its cores and per-operation overheads, so a CPU plan is priced from a
measurement of this host. :func:`host_profile` measures what the predictor reads for one model
shape (tools/profile_host.py's engine): the layers, the embedding and the output layer + loss, the
AdamW step per parameter, on ``min(ranks, cores)`` processes at once on the wall clock and on all
``ranks`` at once on the thread clock (one thread each; :func:`_concurrency`; there each process waits
as its rank's emulated device does and the result is one profile per island), for a pipeline plan the
fixed cost of a chunk call and the zero-bubble B/W split, and the links between ``ranks`` local gloo
processes (every spawned process runs one thread; a one-rank profile is measured in this process with
``threads``). The clock follows the cluster's emulation: on the
"thread" clock (IslandEmulation.clock) a rank's compute lasts its thread CPU time x slowdown, so the
profile is timed in thread CPU time too; on the "wall" clock in wall time, which is only right
while no more ranks compute at once than the host has cores (4 ranks on 2 cores under ZB-H1
measured 2.3x the profile: examples/clusters/cpu-demo-paced.yaml is the demo's answer). It is cached in a
JSON profile (on the thread clock one file per island) keyed by the host (processor, core count, torch version) and the shape, so the second
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
from megatron_het.plan.layout import rank_roles
from megatron_het.schedule.generators import SPLIT_BACKWARD_SCHEDULES

__all__ = ["HostPrediction", "host_key", "host_profile", "predict_on_this_host"]

QUICK_REPEATS, QUICK_WARMUP = 9, 2


@dataclass(frozen=True)
class HostPrediction:
    """A plan's predicted iteration on this host and where its figures came from."""

    iteration_time_s: float  # predicted seconds per iteration
    prediction: Prediction  # the full prediction (stages, memory, ...; a sharded plan's own kind)
    profiles: tuple[Profile, ...]  # the host profiles it was priced from (one, or one per emulated island)
    profile_paths: tuple[str, ...]  # their cache files
    measured_now: bool  # False when the cached profiles were reused

    @property
    def profile(self) -> Profile:
        """The first profile (the only one unless islands are emulated apart)."""
        return self.profiles[0]

    @property
    def profile_path(self) -> str:
        return self.profile_paths[0]


def _concurrency(ranks: int, clock: str = "wall") -> int:
    """Processes the profile is timed on at once. Wall clock: at most one per core (beyond that the
    times would count waiting for a core, which is not a property of the emulated device). Thread
    clock: every rank of the run, because the run's ranks share the cores the same way and their
    CPU time per layer grows with it (caches, switches): 10-12% on the demo's 4 ranks on 2 cores."""
    return max(1, ranks if clock == "thread" else min(ranks, os.cpu_count() or 1))


def _moe_facts(model: ModelSpec) -> dict[str, object]:
    """An MoE model's expert count and every MoE setting the measured layer is built with
    (model/gpt.moe_kwargs: dispatcher, router, losses, capacity) that changes its time."""
    from megatron_het.cluster.model_moe import MOE_FIELDS

    return {"num_experts": model.num_experts, **{f: getattr(model, f) for f in MOE_FIELDS}}


def host_key(model: ModelSpec, *, micro_batch_sizes: Sequence[int], ranks: int, threads: int,
             clock: str = "wall", precision: str = "fp32", emulated: Sequence[tuple[str, float]] | None = None,
             split_backward: bool = False, call_overhead: bool = False) -> str:
    """Cache key: this host (processor, cores, platform, torch) and what is measured (options at their
    defaults are left out, so keys of profiles measured without them stay valid)."""
    import torch

    facts = {"processor": platform.processor() or platform.machine(), "cores": os.cpu_count(),
             "platform": platform.platform(), "torch": torch.__version__,
             "shape": [model.hidden_size, model.num_attention_heads, model.num_query_groups, model.ffn_hidden_size,
                       model.seq_length, padded_vocab_size(model.vocab_size), model.swiglu],
             **({"dropout": [model.hidden_dropout, model.attention_dropout]}
                if model.hidden_dropout or model.attention_dropout else {}),
             **({"moe": _moe_facts(model)} if model.is_moe else {}),
             **({} if model.add_bias_linear else {"add_bias_linear": False}),
             "micro_batch_sizes": sorted(set(micro_batch_sizes)), "ranks": ranks, "threads": threads,
             "concurrent": _concurrency(ranks, clock), **({"clock": clock} if clock != "wall" else {}),
             **({"precision": precision} if precision != "fp32" else {}),
             **({"emulated": [[i, float(f)] for i, f in emulated]} if emulated is not None else {}),
             **({"split_backward": True} if split_backward else {}), **({"call_overhead": True} if call_overhead else {})}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def host_profile(model: ModelSpec, *, micro_batch_sizes: Sequence[int], ranks: int, cache_dir: str | os.PathLike[str],
                 device: str = "CPU", threads: int = 1, clock: str = "wall", precision: str = "fp32",
                 emulated: Sequence[tuple[str, float]] | None = None, split_backward: bool = False,
                 call_overhead: bool = False, refresh: bool = False) -> tuple[tuple[Profile, ...], tuple[str, ...], bool]:
    """(profiles, their files, measured now?) for ``model``'s layer shape on this host, measured on
    ``_concurrency(ranks, clock)`` processes at once (one thread each) with links among ``ranks`` processes,
    timed on ``clock`` ("wall" or "thread": thread CPU time) in ``precision`` (the dtype the run's
    layers train in: "fp32", "bf16" or "fp16"); cached. One profile standing for every island, or with
    ``emulated`` ((island, slowdown) per rank of a run emulated on the thread clock) one per island,
    each process waiting as its rank's device does (profiling.layers.profile_emulated).
    ``split_backward`` also times the zero-bubble B/W split, ``call_overhead`` the fixed cost of a chunk call."""
    import torch

    from megatron_het.profiling.layers import CLOCKS, profile_concurrent, profile_emulated, profile_layers
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
    if emulated is not None and (clock != "thread" or len(emulated) != ranks):
        raise ConfigError("emulated ranks are profiled on the thread clock, one (island, slowdown) per rank",
                          field="emulated", value=list(emulated),
                          fix=f"pass clock='thread' and {ranks} (island, slowdown) pairs, or none")
    key = host_key(model, micro_batch_sizes=micro_batch_sizes, ranks=ranks, threads=threads, clock=clock,
                   precision=precision, emulated=emulated, split_backward=split_backward,
                   call_overhead=call_overhead)
    islands = list(dict.fromkeys(i for i, _ in emulated)) if emulated is not None else [None]
    paths = tuple(Path(cache_dir) / (f"host_profile_{key}.json" if i is None else
                                     f"host_profile_{key}_{k}_{_safe(i)}.json") for k, i in enumerate(islands))
    if all(p.exists() for p in paths) and not refresh:
        cached = tuple(load_profile(p) for p in paths)
        if all(c.device == device and c.island == i for c, i in zip(cached, islands)):
            return cached, tuple(map(str, paths)), False
    options = dict(num_layers=2, micro_batch_sizes=sorted(set(micro_batch_sizes)), device=device,
                   warmup=QUICK_WARMUP, repeats=QUICK_REPEATS, dtype=dtypes[precision], implementation="auto",
                   vocab_size=padded_vocab_size(model.vocab_size), optimizer=True, clock=clock,
                   split_backward=split_backward, call_overhead=call_overhead)
    concurrent = _concurrency(ranks, clock)
    def measure() -> tuple[Profile, ...]:
        if emulated is not None:
            return profile_emulated(model, islands=[i for i, _ in emulated], slowdowns=[f for _, f in emulated],
                                    **options)
        if concurrent == 1:
            return (profile_layers(model, **options),)
        return (profile_concurrent(model, processes=concurrent, **options),)

    if concurrent == 1:  # measured in this process: with the run's threads per rank (spawned ones run one)
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            profiles = measure()
        finally:
            torch.set_num_threads(old)
    else:
        profiles = measure()
    link = measure_link(ranks) if ranks > 1 else None
    out = []
    for prof, path in zip(profiles, paths):
        prof = replace(prof, link=link if link is not None else prof.link,
                       method=prof.method + f"; quick host profile (megatron_het.profiling.host, key {key})")
        path.parent.mkdir(parents=True, exist_ok=True)
        save_profile(prof, path)
        out.append(replace(prof, source=str(path)))
    return tuple(out), tuple(map(str, paths)), True


def _safe(name: str) -> str:
    """An island name as a file-name part (cluster files name islands freely)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64] or "_"


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

    if model.is_moe and model.add_bias_linear:  # checked before minutes of spawning: profiling/layers.py refuses it
        raise ConfigError("a host profile times an MoE layer at expert parallelism 1, where megatron-core cannot "
                          "train expert biases", field="add_bias_linear", value=True,
                          fix="price the model without linear biases (--disable-bias-linear, as Mixtral), or pass a "
                              "profile measured with tools/profile_host.py instead of the host's")
    sharded = isinstance(plan, ShardedPlan)
    sizes = sorted({r.micro_batch_size for r in plan.ranks}) if sharded else [plan.micro_batch_size]
    thread_clock = all(cluster.emulation_clock(i.name) == "thread" for i in cluster.islands)  # "wall" unemulated
    # timed in the dtype the run trains in (runtime/plan_record.py: tf32 plans train in fp32 storage)
    precision = "fp32" if sharded else TRAINS_IN.get(plan.precision, plan.precision)
    # On the thread clock each profiling process stands for one rank and waits as its emulated device
    # does (the run's ranks sleep between actions and wake to colder caches): one profile per island. A
    # pipeline plan's actions are chunk calls, split into B and W under a zero-bubble schedule: both
    # are timed as it runs them.
    emulated = None
    if thread_clock:
        islands = [r.island for r in sorted(plan.ranks, key=lambda r: r.rank)] if sharded else \
            [role.island for _, role in sorted(rank_roles(plan).items())]
        emulated = [(name, cluster.slowdown(name)) for name in islands]
    profiles, paths, fresh = host_profile(model, micro_batch_sizes=sizes, ranks=plan.world_size,
                                          cache_dir=cache_dir, device=devices.pop(), threads=threads,
                                          clock="thread" if thread_clock else "wall", precision=precision,
                                          emulated=emulated, call_overhead=not sharded,
                                          split_backward=not sharded and plan.schedule in SPLIT_BACKWARD_SCHEDULES,
                                          refresh=refresh)
    if sharded:
        from megatron_het.planner.sharded import predict_sharded

        pred = predict_sharded(plan, model, cluster, profile=profiles)
        # the trainer's per-iteration all-reduces (grad norm, loss), which the pipeline predictor adds itself
        seconds = pred.iteration_time_s + SYNC_ALL_REDUCES_PER_ITERATION * small_all_reduce_s(
            cluster, plan.world_size, profile=profiles)
    else:
        pred = predict(plan, model, cluster, profile=profiles)
        seconds = pred.iteration_time_s
    return HostPrediction(iteration_time_s=seconds, prediction=pred, profiles=profiles, profile_paths=paths,
                          measured_now=fresh)
