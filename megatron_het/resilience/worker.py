"""Per-rank driver of a resilient run: the one trainer with resilience hooks (survive failures, re-plan
when re-routing stops paying).

``resilient_train`` is what a rank calls (tests and the benchmark spawn it through
``launch.run_resilient_local``; under torchrun the store address comes from the launcher).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_het.cluster import ClusterSpec, ModelSpec
from megatron_het.plan import Plan, ReplicaPlan
from megatron_het.resilience.agreement import StoreAddress
from megatron_het.resilience.recovery import (
    FailureEvent,
    FaultSpec,
    RankRetired,
    ResilienceConfig,
    ResilienceHooks,
)
from megatron_het.runtime.resilience_options import ResilienceOptions
from megatron_het.train.config import TrainConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RankReport:
    """What one rank did in a resilient run (pickled back to the launcher)."""

    rank: int  # original rank
    status: str  # "finished" or "retired"
    losses: dict[int, float] = field(default_factory=dict)  # iteration (1-based) -> global mean loss
    elapsed_s: dict[int, float] = field(default_factory=dict)  # iteration (1-based) -> wall time of the step
    embedded: dict[int, tuple[int, ...]] = field(default_factory=dict)  # iteration (0-based) -> samples this
    # rank embedded as TP rank 0 of a first stage
    scored: dict[int, tuple[int, ...]] = field(default_factory=dict)  # same, scored as TP rank 0 of a last stage
    events: tuple[FailureEvent, ...] = ()  # failures this rank survived
    replans: tuple[str, ...] = ()  # one line per automatic re-plan
    # at the end of the run: bytes this rank's boundary groups carried through the het bridge (since the
    # last rebuild of the groups) and the path of each of its gradient groups ("native" | "het-bridge")
    boundary_bridge_bytes: int = 0
    gradient_routes: tuple[str, ...] = ()


class LogLines(logging.Handler):
    """Keeps the formatted records it receives, so a spawned rank can return its log to the launcher."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.lines: list[str] = []  # formatted records, in order

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def homogeneous_replan(plan: Plan, num_ranks: int) -> Plan:
    """As many copies of the plan's smallest replica as ``num_ranks`` holds, the global batch kept."""
    shape = min(plan.replicas, key=lambda r: len(r.ranks))
    k = num_ranks // len(shape.ranks)
    if k < 1:
        raise ValueError(f"num_ranks: {num_ranks} survivors cannot hold one replica of {len(shape.ranks)} ranks. "
                         f"Fix: restart with more ranks")
    total = sum(r.num_micro_batches for r in plan.replicas)
    replicas, next_rank = [], 0
    for i in range(k):
        stages = []
        for st in shape.stages:
            stages.append(dataclasses.replace(st, ranks=tuple(range(next_rank, next_rank + st.tp))))
            next_rank += st.tp
        replicas.append(ReplicaPlan(stages=tuple(stages), num_micro_batches=total // k + (i < total % k)))
    return dataclasses.replace(plan, replicas=tuple(replicas))


def resilient_train(*, rank: int, model: ModelSpec, plan: Plan, train: TrainConfig, batch_fn, iterations: int,
                    config: ResilienceConfig, faults: Sequence[FaultSpec] = (), padded_vocab: int | None = None,
                    init_full_state=None, slowdown: float | None = None, clock: Callable[[], float] | None = None,
                    replan: Callable[[Plan, int], Plan] = homogeneous_replan, cluster: ClusterSpec | None = None
                    ) -> RankReport:
    """Train ``iterations`` steps of ``plan`` on this rank, surviving failures (the default group must exist).

    One trainer with ResilienceHooks; a re-plan continues in it on a strategy rebuilt for the new plan.
    ``cluster``: where the plan's islands are (their collective libraries choose native or het-bridge paths).
    Every group of the run, rebuilt ones included, gets ``config.pg_timeout_s`` (bounds a hang on a stuck peer)."""
    from megatron_het.runtime.hetero_trainer import HeteroTrainer, PipelineStrategy

    train = dataclasses.replace(train, distributed_timeout_minutes=config.pg_timeout_s / 60)

    def rebuild(new_plan: Plan) -> PipelineStrategy:
        return PipelineStrategy(model=model, plan=new_plan, train=train, batch_fn=batch_fn, padded_vocab=padded_vocab,
                                cluster=cluster)

    logs, elapsed = {}, {}

    def record(log) -> None:  # the loss is read when the report is built (no host read per iteration)
        logs[log.iteration], elapsed[log.iteration] = log, log.elapsed_s

    hooks = ResilienceHooks(config=config, rank=rank, plan=plan, fault=next((f for f in faults if f.rank == rank), None),
                            rebuild=rebuild, replan=replan)
    trainer = None
    try:
        trainer = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn, hooks=hooks,
                                padded_vocab=padded_vocab, slowdown=slowdown, clock=clock,
                                init_full_state=init_full_state, cluster=cluster)
        trainer.run(iterations, on_iteration=record)
        status = "finished"
    except RankRetired:
        status = "retired"
    finally:
        hooks.close()
    strategy = trainer.strategy if trainer is not None and status == "finished" else None
    return RankReport(rank=rank, status=status, losses={it: log.lm_loss for it, log in logs.items()},
                      elapsed_s=elapsed,
                      embedded={k: tuple(v) for k, v in hooks.embedded.items()},
                      scored={k: tuple(v) for k, v in hooks.scored.items()}, events=tuple(hooks.events),
                      replans=tuple(hooks.replans),
                      boundary_bridge_bytes=sum(g.bridge_bytes() for g in strategy.boundary_bridges.values())
                      if strategy is not None else 0,
                      gradient_routes=tuple(kind for _, kind in strategy.sync.routes) if strategy is not None else ())


def pretrain_hooks(options: ResilienceOptions, *, model: ModelSpec, plan: Plan, train: TrainConfig, batch_fn,
                   padded_vocab: int | None, checkpoint_dir: str | None, staggered_step: bool = False,
                   cluster: ClusterSpec | None = None) -> tuple[TrainConfig, ResilienceHooks]:
    """The hooks ``pretrain_gpt.py --hetero-resilience`` adds to its trainer (this rank = the default
    group's rank, which must exist), and the training config with the failure timeout on every group.

    A re-plan writes the survivors' state to ``checkpoint_dir`` (--save); without it the run keeps
    re-routing while that is possible."""
    from megatron_het.runtime.hetero_trainer import PipelineStrategy

    train = dataclasses.replace(train, distributed_timeout_minutes=options.failure_timeout_s / 60)
    config = ResilienceConfig(store=StoreAddress(host=options.store_host, port=options.store_port),
                              heartbeat_interval_s=options.heartbeat_interval_s,
                              heartbeat_timeout_s=options.failure_timeout_s, pg_timeout_s=options.failure_timeout_s,
                              agreement_timeout_s=options.agreement_timeout_s, checkpoint_dir=checkpoint_dir,
                              mode=options.policy, staggered_step=staggered_step)

    def rebuild(new_plan: Plan) -> PipelineStrategy:  # on the cluster's islands: cross-vendor paths bridged
        return PipelineStrategy(model=model, plan=new_plan, train=train, batch_fn=batch_fn, padded_vocab=padded_vocab,
                                cluster=cluster)

    rank = dist.get_rank()
    f = options.fault
    fault = FaultSpec(rank=f.rank, iteration=f.iteration, after_actions=f.after_actions) if f and f.rank == rank else None
    hooks = ResilienceHooks(config=config, rank=rank, plan=plan, fault=fault, rebuild=rebuild,
                            replan=homogeneous_replan, report_dir=options.report_dir)
    return train, hooks


def resilient_worker(rank: int, world_size: int, address: StoreAddress, model: ModelSpec, plan: Plan,
                     train: TrainConfig, iterations: int, faults: Sequence[FaultSpec] = (),
                     config_overrides: dict | None = None, reference: bool = False, padded_vocab: int | None = None,
                     slowdown: float | None = None, init_full_state=None,
                     clock: Callable[[], float] | None = None, cluster: dict | None = None) -> dict:
    """Module-level rank function for ``run_resilient_local``.

    ``init_full_state``: full initial tensors (same on every rank), for runs that must resume
    exactly from a checkpoint: a HeteroTrainer built without it initialises the last stage's copy of
    a tied word embedding independently of the first stage's, and a checkpoint keeps only one.
    ``clock``: the emulation timer's clock (None: wall time; the bench passes thread CPU time).
    ``cluster``: a cluster file's dict (islands' collective libraries: cross-vendor paths are bridged).

    Returns {"reference": losses of a failure-free run of the same plan (when ``reference``),
    "reference_elapsed" / "reference_compute": its step times / forward+backward times, "report": RankReport of the resilient run, "wall_s": its wall
    time, "log": the lines this rank logged under ``megatron_het.resilience``}.
    """
    from megatron_het.cluster import cluster_from_dict
    from megatron_het.data.synthetic import synthetic_batch
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    enable_cpu_backend()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    log_lines = LogLines()
    logging.getLogger("megatron_het.resilience").addHandler(log_lines)

    def batch_fn(iteration, indices):
        return synthetic_batch(seed=train.seed, iteration=iteration, indices=indices,
                               seq_length=model.seq_length, vocab_size=model.vocab_size)

    spec = cluster_from_dict(cluster) if cluster is not None else None
    out = {}
    if reference:
        ref = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn, padded_vocab=padded_vocab,
                            slowdown=slowdown, clock=clock, init_full_state=init_full_state, cluster=spec)
        logs = ref.run(iterations).iterations
        out["reference"] = {log.iteration: log.lm_loss for log in logs}
        out["reference_elapsed"] = {log.iteration: log.elapsed_s for log in logs}
        out["reference_compute"] = {log.iteration: log.compute_s for log in logs}
        del ref
        dist.barrier()
    config = ResilienceConfig(store=address, **(config_overrides or {}))
    start = time.time()
    out["report"] = resilient_train(rank=rank, model=model, plan=plan, train=train, batch_fn=batch_fn,
                                    iterations=iterations, config=config, faults=faults,
                                    padded_vocab=padded_vocab, slowdown=slowdown, clock=clock,
                                    init_full_state=init_full_state, cluster=spec)
    out["wall_s"] = time.time() - start
    out["log"] = list(log_lines.lines)
    return out
