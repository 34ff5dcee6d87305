"""Trainer hooks that keep training in-process after rank failures (no restart, no reload).

On an exception inside an iteration: agree with the other survivors on who failed
(``agreement.py``), decide re-route vs re-plan (``policy.py``), drop the broken process groups,
re-initialise the world among the survivors (ranks renumbered, generation-prefixed store keys),
rebuild this rank's stage on the new groups with its parameters and optimizer state moved over
from memory, and run the routed schedule (``routed_schedule.py``) from then on. The iteration that
failed is discarded on every survivor (no optimizer step happened anywhere: the trainer reports the
loss before stepping) and redone, so the sequence of updates equals the failure-free run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import signal
import time
from dataclasses import dataclass

import torch.distributed as dist

from megatron_het.plan import Plan, ReplicaPlan
from megatron_het.resilience.agreement import Heartbeat, StoreAddress, agree_on_failures
from megatron_het.resilience.executor import RoutedExecutor
from megatron_het.resilience.policy import Decision, PolicyConfig, decide
from megatron_het.resilience.routed_schedule import routed_schedule
from megatron_het.resilience.routing import Routing, describe, reroute
from megatron_het.runtime.hetero_trainer import TrainerHooks

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ResilienceConfig:
    """Timeouts of detection and agreement, and the schedule used after a failure."""

    store: StoreAddress  # rendezvous store outside the training ranks
    heartbeat_interval_s: float = 0.5  # how often each rank writes its heartbeat
    heartbeat_timeout_s: float = 5.0  # a heartbeat older than this marks a silent rank as failed
    agreement_timeout_s: float = 60.0  # a rank that has not joined the agreement by then is declared failed
    pg_timeout_s: float = 15.0  # timeout of the rebuilt process groups (bounds a hang on a stuck peer)
    split_backward: bool = True  # routed schedule with separate B/W actions (zero-bubble style)
    policy: PolicyConfig = PolicyConfig()  # re-route vs re-plan
    checkpoint_dir: str | None = None  # where a re-plan writes the survivors' state (None: no re-plan)

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s <= self.agreement_timeout_s:
            raise ValueError(
                f"heartbeat_interval_s/heartbeat_timeout_s/agreement_timeout_s: need 0 < interval < timeout <= "
                f"agreement timeout (got {self.heartbeat_interval_s}, {self.heartbeat_timeout_s}, "
                f"{self.agreement_timeout_s}). Fix: e.g. 0.5, 5 and 60 seconds")


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """Fault injection for tests and benchmarks: SIGKILL a rank at a point of an iteration."""

    rank: int  # original rank that kills itself
    iteration: int  # 0-based iteration in which it dies
    after_actions: int = 1  # number of schedule actions it completes in that iteration first


@dataclass(frozen=True, kw_only=True)
class FailureEvent:
    """One failure as seen by one survivor (the per-failure log line, as data)."""

    generation: int  # 1, 2, ... in order of failures
    iteration: int  # iteration (0-based) that was interrupted and redone
    failed: tuple[int, ...]  # original ranks that failed
    error: str  # first line of the exception that revealed it
    detected_at: float  # wall time this rank caught the error
    agreed_at: float  # wall time the survivors' decision was read
    resumed_at: float  # wall time the new groups and stage were ready
    decision: str  # "reroute" or "replan" with its reason
    takeovers: tuple[str, ...]  # who took over which micro-batches
    world_size: int  # size of the new world


class RankRetired(Exception):
    """This rank leaves the job: it was declared failed, or its TP group lost a member."""


class RecoveryError(RuntimeError):
    """The job cannot continue in-process (no surviving holder of some layers and no checkpoint_dir)."""


class ReplanRequired(Exception):
    """Re-routing does not pay: the caller re-plans over the survivors (see worker.resilient_train)."""

    def __init__(self, decision: Decision, routing: Routing | None) -> None:
        super().__init__(decision.reason)
        self.decision, self.routing = decision, routing


def instances_plan(routing: Routing, template: Plan) -> Plan:
    """A plan with one single-stage replica per surviving instance, ranks renumbered.

    Only used to build each instance's TP groups with ``build_stage_groups`` (which needs every
    stage's ranks); it is not a trainable plan.
    """
    replicas = []
    for inst in routing.instances:
        st = template.replicas[inst.key[0]].stages[inst.key[1]]
        new = tuple(routing.new_rank(r) for r in inst.ranks)
        replicas.append(ReplicaPlan(stages=(dataclasses.replace(st, ranks=new),), num_micro_batches=1))
    return Plan(replicas=tuple(replicas), micro_batch_size=template.micro_batch_size,
                global_batch_size=template.micro_batch_size * len(replicas))


def rebind_trainer(trainer, routing: Routing, old_rank: int) -> None:
    """Move this rank's stage onto the current (rebuilt) world: new groups, new stage objects,
    same parameter values and optimizer state (taken from memory)."""
    from megatron_het.runtime.boundary import BoundaryLink
    from megatron_het.runtime.gpt_model import build_gpt_stage
    from megatron_het.runtime.grad_sync import GradientSynchronizer
    from megatron_het.runtime.stage_groups import build_stage_groups

    pgc, _ = build_stage_groups(instances_plan(routing, trainer.plan))
    gpt = build_gpt_stage(trainer.stage, trainer.config, pgc)
    if trainer.stage_plan.tp_comm_overlap:  # the new stage model takes the overlapped path like the old one
        from megatron_het.comm.overlap_megatron import apply_tp_comm_overlap

        trainer.overlap_report = apply_tp_comm_overlap(gpt, chunks=trainer.train.tp_comm_overlap_chunks)
    gpt.load_state_dict(trainer.gpt.state_dict())
    opt_state = trainer.optimizer.state_dict()
    trainer.gpt, trainer.pgc = gpt, pgc
    trainer.role = dataclasses.replace(trainer.role, rank=routing.new_rank(old_rank))
    trainer.params = trainer._named_global_params()
    decay = [p for n, p in trainer.params.items() if not (p.dim() == 1 or n.endswith(".bias"))]
    no_decay = [p for n, p in trainer.params.items() if p.dim() == 1 or n.endswith(".bias")]
    trainer.optimizer = type(trainer.optimizer)(
        [{"params": decay, "weight_decay": trainer.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=trainer.train.lr, betas=(trainer.train.adam_beta1, trainer.train.adam_beta2), eps=trainer.train.adam_eps)
    trainer.optimizer.load_state_dict(opt_state)  # same parameter order: state moves by position
    trainer.sync = GradientSynchronizer(trainer._holdings(), trainer.params)  # plain groups among survivors
    trainer.link = BoundaryLink(tp_rank=trainer.role.tp_rank, tp=trainer.role.tp_size, prev=None, next=None,
                                sequence_parallel=trainer.plan.sequence_parallel)


def _groups() -> list:
    from torch.distributed import distributed_c10d as c10d

    return list(c10d._world.pg_map) if dist.is_initialized() else []


def bound_group_timeouts(timeout_s: float) -> None:
    """Give every existing group ``timeout_s``: a peer that hangs is detected within that time."""
    for pg in _groups():
        try:
            pg.set_timeout(datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, AttributeError):  # a backend without set_timeout keeps its own
            pass


@contextlib.contextmanager
def bounded_new_groups(timeout_s: float):
    """Groups created inside get ``timeout_s`` instead of torch's 30-minute default.

    The trainer's group builders take no timeout argument; torch reads its module-level default
    when a group is created, so it is swapped for the duration of the block and restored.
    (``ProcessGroup.set_timeout`` after the fact did not bound gloo collectives of subgroups.)
    """
    from torch.distributed import distributed_c10d as c10d

    saved = c10d.default_pg_timeout
    c10d.default_pg_timeout = datetime.timedelta(seconds=timeout_s)
    try:
        yield
    finally:
        c10d.default_pg_timeout = saved


def abort_all_groups() -> None:
    """Abort every group (closes its connections: peers blocked on us fail now) and destroy the world."""
    for pg in _groups():
        try:
            pg.abort()
        except (RuntimeError, AttributeError):
            pass
    if dist.is_initialized():
        dist.destroy_process_group()


class ResilienceHooks(TrainerHooks):
    """Detect, agree, re-route, continue. One object per rank; pass it as ``HeteroTrainer(hooks=...)``."""

    def __init__(self, *, config: ResilienceConfig, rank: int, plan: Plan, fault: FaultSpec | None = None,
                 epoch: int = 0) -> None:
        """``rank``: this rank in ``plan``; ``epoch``: 0, then +1 per re-plan (separates store keys)."""
        self.config, self.rank, self.plan, self.fault, self.epoch = config, rank, plan, fault, epoch
        self.store = dist.PrefixStore(f"e{epoch}/", config.store.connect())
        self.heartbeat = Heartbeat(config.store, rank, interval_s=config.heartbeat_interval_s, prefix=f"e{epoch}/")
        self.failed: frozenset[int] = frozenset()
        self.members: tuple[int, ...] = tuple(range(plan.world_size))  # original ranks in the current world
        self.generation = 0
        self.routing: Routing | None = None
        self.executor: RoutedExecutor | None = None
        self.events: list[FailureEvent] = []
        # Accounting, per completed iteration (0-based): samples this rank embedded / scored as TP
        # rank 0 of a first / last stage. Kept apart because a re-plan may give a rank another stage.
        self.embedded: dict[int, list[int]] = {}
        self.scored: dict[int, list[int]] = {}
        self._step_samples: list[int] = []
        self._bounded = False  # set_timeout applied to the current groups

    # ---- hook points --------------------------------------------------------------------------
    def on_step_start(self, trainer, iteration: int) -> None:
        self._step_samples = []
        if not self._bounded:  # groups made by the trainer use torch's default (30 min) timeout
            bound_group_timeouts(self.config.pg_timeout_s)
            self._bounded = True

    def on_action(self, trainer, iteration: int, index: int, action) -> None:
        f = self.fault
        if f is not None and f.rank == self.rank and f.iteration == iteration and index >= f.after_actions:
            self.store.set(f"killed/{self.rank}", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if self.executor is None and action.kind == "F" and (trainer.is_first or trainer.is_last):
            mbs = trainer.train.micro_batch_size
            from megatron_het.runtime.hetero_trainer import replica_first_micro_batch

            first = (replica_first_micro_batch(trainer.plan, trainer.role.replica) + action.micro_batch) * mbs
            self._step_samples += list(range(first, first + mbs))

    def run_actions(self, trainer, iteration: int, times):
        if self.executor is None:
            return None
        loss = self.executor.run(trainer, iteration, times)
        self._step_samples = list(self.executor.samples)
        return loss

    def on_step_end(self, trainer, log) -> None:
        if trainer.role.tp_rank == 0:
            if trainer.is_first:
                self.embedded[log.iteration - 1] = self._step_samples
            if trainer.is_last:
                self.scored[log.iteration - 1] = self._step_samples

    def on_failure(self, trainer, iteration: int, error: BaseException) -> bool:
        detected = time.time()
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        logger.warning("rank %d: iteration %d failed (%s); agreeing on failed ranks", self.rank, iteration,
                       first_line)
        trainer.link._pending.clear()
        # Close our connections at once: a peer blocked on us (not on the dead rank) then fails too
        # instead of waiting for its timeout, so every survivor joins the agreement quickly.
        abort_all_groups()
        self.generation += 1
        agreement = agree_on_failures(self.store, generation=self.generation, rank=self.rank, members=self.members,
                                      iteration=iteration, heartbeat_timeout_s=self.config.heartbeat_timeout_s,
                                      timeout_s=self.config.agreement_timeout_s)
        agreed = time.time()
        if self.rank in agreement.failed:
            raise RankRetired(f"rank {self.rank} was declared failed in generation {self.generation}") from error
        self.failed = self.failed | frozenset(agreement.failed)
        decision = decide(self.plan, self.failed, config=self.config.policy)
        if decision.action == "replan" and self.config.checkpoint_dir is None:
            if decision.reroute_fraction == 0.0:
                raise RecoveryError(f"ranks {sorted(self.failed)} failed: {decision.reason}; in-process recovery "
                                    f"is impossible and checkpoint_dir is not set. Fix: restart from the last "
                                    f"checkpoint, or set ResilienceConfig.checkpoint_dir") from error
            decision = dataclasses.replace(decision, action="reroute", reason=decision.reason + " (no "
                                           "checkpoint_dir for a re-plan: re-routing anyway)")
        routing = reroute(self.plan, self.failed) if decision.reroute_fraction > 0 else None
        survivors = routing.survivors if routing is not None else tuple(m for m in self.members
                                                                         if m not in self.failed)
        self._new_world(survivors)
        if routing is not None and self.rank in routing.retired:
            raise RankRetired(f"rank {self.rank} retires: its TP group lost ranks {sorted(self.failed)}") from error
        if routing is not None:
            with bounded_new_groups(self.config.pg_timeout_s):
                rebind_trainer(trainer, routing, self.rank)
        if decision.action == "replan":
            saved = None
            if routing is not None:  # every layer still has a holder: write the current state
                trainer.save_checkpoint(self.config.checkpoint_dir)
                saved = trainer.iteration
            logger.warning("rank %d: generation %d: ranks %s failed in iteration %d; %s -> AUTOMATIC RE-PLAN over "
                           "%d survivors from %s", self.rank, self.generation, sorted(agreement.failed), iteration,
                           decision.reason, len(survivors),
                           f"the survivors' state (iteration {saved})" if saved is not None else
                           "the last checkpoint")
            raise ReplanRequired(decision, routing) from error
        sched = routed_schedule(routing, split_backward=self.config.split_backward)
        key = routing.instance_of(self.rank).key
        self.routing = routing
        self.executor = RoutedExecutor(routing=routing, schedule=sched, key=key, tp_rank=trainer.role.tp_rank,
                                       on_action=lambda it, i, a: self.on_action(trainer, it, i, a),
                                       sequence_parallel=trainer.plan.sequence_parallel)
        event = FailureEvent(generation=self.generation, iteration=iteration, failed=agreement.failed,
                             error=first_line, detected_at=detected, agreed_at=agreed, resumed_at=time.time(),
                             decision=f"{decision.action}: {decision.reason}", takeovers=tuple(describe(routing)),
                             world_size=len(survivors))
        self.events.append(event)
        logger.warning("rank %d: generation %d: ranks %s failed in iteration %d; agreed %.2f s after this "
                       "rank's error (decision by rank %d), resumed %.2f s later on %d ranks; %s; %s",
                       self.rank, self.generation, list(agreement.failed), iteration, agreed - detected,
                       agreement.decided_by, event.resumed_at - agreed, len(survivors), event.decision,
                       "; ".join(event.takeovers) or "no takeovers")
        return True

    def _new_world(self, survivors) -> None:
        """Destroy the broken groups; survivors join a fresh world under a generation prefix."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.members = tuple(survivors)
        if self.rank not in survivors:
            return
        dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{self.generation}/", self.store),
                                rank=survivors.index(self.rank), world_size=len(survivors),
                                timeout=datetime.timedelta(seconds=self.config.pg_timeout_s))

    def close(self) -> None:
        self.heartbeat.stop()
