"""Trainer hooks that keep training in-process after rank failures (no restart, no reload).

On an exception inside an iteration: agree with the other survivors on who failed
(``agreement.py``), decide re-route vs re-plan (``policy.py``), drop the broken process groups,
re-initialise the world among the survivors (ranks renumbered, generation-prefixed store keys),
rebind this rank's stage to the new groups (``PipelineStrategy.rebind``: parameters and optimizer
state move over from memory) and run the routed schedule (``routed_schedule.py``) from then on. When
re-routing does not pay, the survivors checkpoint, re-plan (a callback) and continue on a strategy
rebuilt for the new plan, in the same trainer. The iteration that failed is discarded on every
survivor (no optimizer step happened anywhere: the strategy reports the loss before stepping) and
redone, so the sequence of updates equals the failure-free run.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_het.cluster import ConfigError
from megatron_het.plan import Plan, ReplicaPlan
from megatron_het.platform import detect_accelerator
from megatron_het.resilience.agreement import Heartbeat, StoreAddress, agree_on_failures
from megatron_het.resilience.policy import Decision, PolicyConfig, decide
from megatron_het.resilience.routed_schedule import routed_schedule
from megatron_het.resilience.routed_transfers import routed_transfer_steps
from megatron_het.resilience.routing import InstanceKey, Routing, describe, reroute
from megatron_het.runtime.boundary import BoundaryLink, Neighbour
from megatron_het.runtime.boundary_groups import BoundaryKey, create_boundary_groups, group_with, pair_boundaries
from megatron_het.runtime.comm_routing import RankPlacement
from megatron_het.runtime.hetero_trainer import PipelineStrategy
from megatron_het.train.trainer import Trainer, TrainerHooks

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
    mode: str = "auto"  # auto: the policy decides; reroute: re-route whenever possible; replan: always re-plan
    staggered_step: bool = False  # each stage steps right after its own gradient reduction (ReCycle); the
    # hooks then keep the iteration's starting state to undo a step taken before a peer failed (fp32 only)

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "reroute", "replan"):
            raise ValueError(f"mode: {self.mode!r} is not auto, reroute or replan. Fix: pick one of the three")
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


def routed_placement(routing: Routing, placement: RankPlacement) -> RankPlacement:
    """``placement`` (ranks of the plan) renumbered to the survivors' new ranks (pure)."""
    return RankPlacement(island={routing.new_rank(r): placement.island[r] for r in routing.survivors},
                         library={routing.new_rank(r): placement.library[r] for r in routing.survivors})


def routed_boundary_ranks(routing: Routing) -> list[tuple[int, ...]]:
    """New ranks of every distinct pair of neighbouring instances on the routed pipelines, in
    pipeline order (the same list on every survivor: groups over them are created in this order)."""
    out: list[tuple[int, ...]] = []
    for pipe in routing.pipelines:
        for a, b in zip(pipe.hops, pipe.hops[1:]):
            ranks = tuple(sorted(routing.new_rank(r) for r in (*routing.instance(a).ranks, *routing.instance(b).ranks)))
            if ranks not in out:
                out.append(ranks)
    return out


def routed_bridges(routing: Routing, placement: RankPlacement, *, accelerator, timeout=None) -> dict:
    """New ranks of a routed boundary -> its het bridge group, for every boundary whose two instances
    use different collective libraries (None on non-members), as the plan's own boundaries get them.
    ``placement``: over the new ranks. Collective over the survivors' world."""
    from megatron_het.runtime.comm_routing import new_bridge_group

    return {ranks: new_bridge_group(ranks, placement, accelerator=accelerator, timeout=timeout)
            for ranks in routed_boundary_ranks(routing) if placement.spans_libraries(ranks)}


def routed_boundary_keys(routing: Routing) -> list[BoundaryKey]:
    """Every routed boundary, in new ranks (the same list on every survivor)."""
    def ranks(hop: InstanceKey) -> tuple[int, ...]:
        return tuple(routing.new_rank(r) for r in routing.instance(hop).ranks)

    return pair_boundaries((ranks(a), ranks(b)) for pipe in routing.pipelines for a, b in zip(pipe.hops, pipe.hops[1:]))


def routed_links(routing: Routing, key: InstanceKey, plan: Plan, *, tp_rank: int,
                 device=None, bridges: Mapping[tuple[int, ...], object] | None = None,
                 groups: Mapping[BoundaryKey, object] | None = None) -> dict[int, BoundaryLink]:
    """Per global micro-batch of instance ``key``: the link to its neighbours on that micro-batch's
    pipeline (received tensors on ``device``, the accelerator's; None: the host). ``bridges``
    (``routed_bridges``): a neighbour across collective libraries is reached through its bridge;
    ``groups`` (``create_boundary_groups`` over ``routed_boundary_keys``): the group of each native
    boundary (None: the default group)."""
    links: dict[int, BoundaryLink] = {}
    mine = routing.instance(key)
    mine_new = tuple(routing.new_rank(r) for r in mine.ranks)
    bridges = bridges or {}

    def neighbour(hop: InstanceKey) -> Neighbour:  # island and stage are named when a transfer fails
        ranks = tuple(routing.new_rank(r) for r in routing.instance(hop).ranks)
        pair = tuple(sorted((*ranks, *mine_new)))
        return Neighbour(ranks=ranks, island=plan.replicas[hop[0]].stages[hop[1]].island, stage=hop[1],
                         bridge=bridges.get(pair), **group_with(ranks, mine_new, groups or {}))

    for pipe in routing.pipelines:
        if key not in pipe.hops:
            continue
        s = pipe.hops.index(key)
        link = BoundaryLink(tp_rank=tp_rank, tp=len(mine.ranks),
                            prev=neighbour(pipe.hops[s - 1]) if s > 0 else None,
                            next=neighbour(pipe.hops[s + 1]) if s + 1 < len(pipe.hops) else None,
                            sequence_parallel=plan.sequence_parallel, device=device)
        links.update(dict.fromkeys(pipe.micro_batches, link))
    return links


def rebind(strategy: PipelineStrategy, routing: Routing, rank: int, *, split_backward: bool) -> None:
    """Move ``strategy`` (this rank = ``rank`` of ``strategy.plan``) onto the current, rebuilt world and
    the routed schedule of ``routing`` (collective over the survivors); groups get the run's timeout.
    Routed boundaries across collective libraries go through the het bridge (``routed_bridges``), as
    the plan's own boundaries do; the rebuilt gradient groups choose their path in ``strategy.rebind``."""
    from megatron_het.runtime.stage_groups import build_stage_groups

    acc = strategy.accelerator
    library = {strategy.plan_placement.island[r]: lib for r, lib in strategy.plan_placement.library.items()}
    pgc, _ = build_stage_groups(instances_plan(routing, strategy.plan), timeout=strategy.train.group_timeout,
                                backend_of=lambda island: acc.backend_for(library[island]), device_id=acc.eager_device)
    key = routing.instance_of(rank).key
    schedule = routed_schedule(routing, split_backward=split_backward)
    placement = routed_placement(routing, strategy.plan_placement)
    bridges = routed_bridges(routing, placement, accelerator=acc, timeout=strategy.train.group_timeout)
    groups = create_boundary_groups(routed_boundary_keys(routing), spans_libraries=placement.spans_libraries,
                                    backend=acc.torch_backend, timeout=strategy.train.group_timeout,
                                    device_id=acc.eager_device)
    links = routed_links(routing, key, strategy.plan, tp_rank=strategy.role.tp_rank, device=strategy.device,
                         bridges=bridges, groups=groups)
    strategy.rebind(pgc=pgc, ranks={r: routing.new_rank(r) for r in routing.survivors}, actions=schedule.actions[key],
                    links=links, split_backward=split_backward, steps=routed_transfer_steps(routing, schedule, key))
    strategy.boundary_bridges = {ranks: g for ranks, g in bridges.items() if g is not None}  # counters, logs
    if bridges and routing.new_rank(rank) == 0:
        logger.info("routed pipeline boundaries: %d native (%s), %d het-bridge",
                    len(routed_boundary_ranks(routing)) - len(bridges), acc.torch_backend, len(bridges))


def forced(decision: Decision, mode: str) -> Decision:
    """``decision`` under ``ResilienceConfig.mode``: reroute keeps re-routing while it is possible,
    replan always re-plans; auto keeps the simulator's choice."""
    if mode == "reroute" and decision.action == "replan" and decision.reroute_fraction > 0:
        return dataclasses.replace(decision, action="reroute", reason=decision.reason + " (policy reroute: "
                                   "re-routing anyway)")
    if mode == "replan" and decision.action == "reroute":
        return dataclasses.replace(decision, action="replan", reason=decision.reason + " (policy replan)")
    return decision


def _groups() -> list:
    from torch.distributed import distributed_c10d as c10d

    return list(c10d._world.pg_map) if dist.is_initialized() else []


def abort_all_groups() -> None:
    """Abort every group (closes its connections: peers blocked on us fail now) and destroy the world."""
    for pg in _groups():
        try:
            pg.abort()
        except (RuntimeError, AttributeError):
            pass
    if dist.is_initialized():
        dist.destroy_process_group()


# (plan over the survivors) -> this rank's strategy under it (collective over the current world)
Rebuild = Callable[[Plan], PipelineStrategy]
# (old plan, number of survivors) -> the plan to continue with
Replan = Callable[[Plan, int], Plan]


class ResilienceHooks(TrainerHooks):
    """Detect, agree, re-route or re-plan, continue. One object per rank, on the trainer of a pipeline plan."""

    def __init__(self, *, config: ResilienceConfig, rank: int, plan: Plan, fault: FaultSpec | None = None,
                 rebuild: Rebuild | None = None, replan: Replan | None = None, report_dir: str | None = None) -> None:
        """``rank``: this rank in ``plan``; ``rebuild`` and ``replan`` make a re-plan possible (with
        ``config.checkpoint_dir``): without them a re-plan decision ends the run. ``report_dir``:
        ``close`` writes ``rank{rank}.json`` there (failures survived, samples read per iteration)."""
        if plan.use_distributed_optimizer:  # a lost rank takes its optimizer shards with it
            raise ConfigError("in-process fault tolerance keeps every holder's full optimizer state so a peer can "
                              "take over; the distributed optimizer shards it, and a dead rank's shards are lost",
                              field="use_distributed_optimizer", value=True,
                              fix="run --hetero-resilience with a plan whose use_distributed_optimizer is false "
                                  "(and without --use-distributed-optimizer), or drop --hetero-resilience")
        if plan.expert_parallel != 1 or plan.expert_tensor_parallel is not None:
            # a re-route gives a survivor more micro-batches than its expert-domain peers, and the rebuilt
            # groups would carry no expert grid: the MoE all-to-alls would no longer meet
            raise ConfigError("in-process fault tolerance cannot keep expert-parallel replicas in step yet",
                              field="expert_parallel", value=plan.expert_parallel,
                              fix="drop --hetero-resilience, or train with expert_parallel 1")
        self.config, self.fault, self.report_dir = config, fault, report_dir
        self.rebuild, self.replan = rebuild, replan
        self.original_rank = rank  # in the first plan (the report's rank)
        self.events: list[FailureEvent] = []
        self.replans: list[str] = []  # one line per automatic re-plan
        # Accounting, per completed iteration (0-based): samples this rank embedded / scored as TP
        # rank 0 of a first / last stage. Kept apart because a re-plan may give a rank another stage.
        self.embedded: dict[int, list[int]] = {}
        self.scored: dict[int, list[int]] = {}
        self.heartbeat: Heartbeat | None = None
        self._start_epoch(plan, rank, epoch=0)

    def _start_epoch(self, plan: Plan, rank: int, *, epoch: int) -> None:
        """State of one plan: 0, then +1 per re-plan (separates the store keys of the epochs)."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.plan, self.rank, self.epoch = plan, rank, epoch
        self.store = dist.PrefixStore(f"e{epoch}/", self.config.store.connect())
        self.heartbeat = Heartbeat(self.config.store, rank, interval_s=self.config.heartbeat_interval_s,
                                   prefix=f"e{epoch}/")
        self.failed: frozenset[int] = frozenset()
        self.members: tuple[int, ...] = tuple(range(plan.world_size))  # ranks of ``plan`` in the current world
        self.generation = 0
        self.windows: dict[int, tuple[int, int]] = {}  # global micro-batch -> local layers run (covers)
        self._undo = None  # staggered step: (model, optimizer) state at the start of the current iteration

    # ---- hook points --------------------------------------------------------------------------
    def on_step_start(self, trainer: Trainer, iteration: int) -> None:
        strategy = trainer.strategy
        if not self.config.staggered_step:
            return
        if strategy.main is not None:
            raise ValueError(f"staggered_step: needs fp32 training (got precision {strategy.train.precision}): "
                             f"undoing a step also needs the main parameters. Fix: drop staggered_step or use fp32")
        strategy.staggered_step = True
        # a stage may step before a peer's failure surfaces in a later collective: keep what undoes it
        self._undo = ({k: v.detach().clone() for k, v in strategy.gpt.state_dict().items() if torch.is_tensor(v)},
                      copy.deepcopy(strategy.optimizer.state_dict()))

    def _undo_step(self, trainer: Trainer) -> None:
        """Back to the state the failed iteration started from (a staggered step may have been taken)."""
        if self._undo is None:
            return
        model, optimizer = self._undo
        trainer.strategy.gpt.load_state_dict(model, strict=False)
        trainer.strategy.optimizer.load_state_dict(optimizer)
        self._undo = None

    def on_action(self, trainer: Trainer, iteration: int, index: int, action) -> None:
        if self.windows:
            trainer.strategy.layer_window = self.windows.get(action.micro_batch) if action.kind == "F" else None
        f = self.fault
        if f is not None and f.rank == self.rank and f.iteration == iteration and index >= f.after_actions:
            self.store.set(f"killed/{self.rank}", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    def on_step_end(self, trainer: Trainer, log) -> None:
        strategy = trainer.strategy
        if strategy.role.tp_rank == 0:
            samples = list(strategy.executor.samples)
            if strategy.is_first:
                self.embedded[log.iteration - 1] = samples
            if strategy.is_last:
                self.scored[log.iteration - 1] = samples

    def on_failure(self, trainer: Trainer, iteration: int, error: BaseException) -> bool:
        detected = time.time()
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        logger.warning("rank %d: iteration %d failed (%s); agreeing on failed ranks", self.rank, iteration,
                       first_line)
        # Close our connections at once: a peer blocked on us (not on the dead rank) then fails too
        # instead of waiting for its timeout, so every survivor joins the agreement quickly.
        abort_all_groups()
        self._undo_step(trainer)
        self.generation += 1
        agreement = agree_on_failures(self.store, generation=self.generation, rank=self.rank, members=self.members,
                                      iteration=iteration, heartbeat_timeout_s=self.config.heartbeat_timeout_s,
                                      timeout_s=self.config.agreement_timeout_s)
        agreed = time.time()
        if self.rank in agreement.failed:
            raise RankRetired(f"rank {self.rank} was declared failed in generation {self.generation}") from error
        self.failed = self.failed | frozenset(agreement.failed)
        can_replan = self.config.checkpoint_dir is not None and self.rebuild is not None and self.replan is not None
        decision = forced(decide(self.plan, self.failed, config=self.config.policy,
                                  split_backward=self.config.split_backward,
                                  staggered=self.config.staggered_step), self.config.mode)
        if decision.action == "replan" and not can_replan:
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
            rebind(trainer.strategy, routing, self.rank, split_backward=self.config.split_backward)
            # global micro-batches this rank runs on part of its layers (it covers part of a lost stage)
            self.windows = routing.windows(routing.instance_of(self.rank).key)
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
            self._replan(trainer, decision.reason)
            return True
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

    def _replan(self, trainer: Trainer, reason: str) -> None:
        """A new plan over the current world, its strategy, the latest checkpoint loaded (collective)."""
        from megatron_het.checkpoint.dist_ckpt import iteration_dir, latest_iteration

        survivors = dist.get_world_size()
        new_plan = self.replan(self.plan, survivors)
        new_rank = dist.get_rank()
        load = latest_iteration(self.config.checkpoint_dir)
        self.replans.append(f"re-plan after ranks {sorted(self.failed)} failed: {reason}; "
                            f"{len(new_plan.replicas)} replicas on {new_plan.world_size} of {survivors} survivors, "
                            f"resuming from iteration {load}")
        logger.warning("rank %d: %s", self.original_rank, self.replans[-1])
        if new_rank >= new_plan.world_size:
            raise RankRetired(f"rank {self.original_rank} is not in the new plan of {new_plan.world_size} ranks")
        self.fault = None
        self._start_epoch(new_plan, new_rank, epoch=self.epoch + 1)
        trainer.use_strategy(self.rebuild(new_plan), iteration=0)  # 0: no checkpoint, start over
        if load is not None:
            trainer.load_checkpoint(iteration_dir(self.config.checkpoint_dir, load))

    def _new_world(self, survivors) -> None:
        """Destroy the broken groups; survivors join a fresh world under a generation prefix."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.members = tuple(survivors)
        if self.rank not in survivors:
            return
        dist.init_process_group(detect_accelerator().world_backend,
                                store=dist.PrefixStore(f"gen{self.generation}/", self.store),
                                rank=survivors.index(self.rank), world_size=len(survivors),
                                timeout=datetime.timedelta(seconds=self.config.pg_timeout_s))

    def report(self) -> dict:
        """What this rank survived and read, as JSON-able data (the ``report_dir`` file)."""
        return {"rank": self.original_rank, "events": [dataclasses.asdict(e) for e in self.events],
                "replans": list(self.replans),
                "embedded": {str(k): v for k, v in sorted(self.embedded.items())},
                "scored": {str(k): v for k, v in sorted(self.scored.items())}}

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.report_dir is not None:
            import json
            from pathlib import Path

            from megatron_het.utils.atomic import write_text_atomic

            Path(self.report_dir).mkdir(parents=True, exist_ok=True)
            write_text_atomic(Path(self.report_dir) / f"rank{self.original_rank}.json", json.dumps(self.report()))
