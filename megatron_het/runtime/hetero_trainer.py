"""Train one GPT under a heterogeneous Plan: uneven TP/PP per device type, uneven micro-batches.

One rank = one place in the plan (replica, stage, TP rank). The stage's model is a megatron-core
GPTModel holding the stage's layers, built with the stage's own process groups. Each iteration the
rank runs its stage's action list from the plan's schedule (``megatron_het.schedule``, the same
data the performance model simulates), moving activations/gradients to neighbour stages of any TP
size (``boundary.py``), then gradients are summed over every holder of each full parameter
(``grad_sync.py``), clipped by the global norm and applied by AdamW with Megatron's weight-decay
groups. Each micro-batch's loss is divided by the *global* micro-batch count, so the sum over
replicas of different sizes is the mean gradient over the whole global batch.

Overlap options (docs/overlap.md): the plan's ``sequence_parallel`` shards activations along the
sequence inside each TP group (boundaries re-split them between TP sizes); a stage whose plan sets
``tp_comm_overlap`` switches its TP linears to the chunked collective/GEMM path
(``comm/overlap_megatron.py``); ``TrainConfig.overlap_grad_reduce`` launches the cross-replica
gradient buckets from gradient hooks during each stage's last backward (``comm/overlap_grad.py``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_het.checkpoint.full_state import (
    TIED_OUTPUT,
    WORD_EMBEDDING,
    Shard,
    global_name,
    load_full_state,
    local_shards,
)
from megatron_het.checkpoint.tp_layout import is_glu
from megatron_het.cluster import ClusterSpec, ModelSpec
from megatron_het.plan import Plan
from megatron_het.plan.validate import check_tp_comm_overlap
from megatron_het.runtime.boundary import BoundaryLink, Neighbour
from megatron_het.runtime.comm_routing import rank_placement
from megatron_het.runtime.gpt_model import StageModelSpec, build_gpt_stage, padded_vocab_size, transformer_config
from megatron_het.runtime.grad_sync import GradientSynchronizer, Holding
from megatron_het.runtime.megatron_trainer import IterationLog, RunResult, split_tokens
from megatron_het.runtime.stage_groups import build_stage_groups
from megatron_het.runtime.train_config import TrainConfig
from megatron_het.schedule import build_schedule

logger = logging.getLogger(__name__)

BatchFn = Callable[[int, range], torch.Tensor]


def plan_padded_vocab(model: ModelSpec, plan: Plan) -> int:
    """One padded vocabulary for every stage: a multiple of 128 x every TP size in the plan."""
    lcm = 1
    for replica in plan.replicas:
        for stage in replica.stages:
            lcm = math.lcm(lcm, stage.tp)
    return padded_vocab_size(model.vocab_size, lcm)


def replica_first_micro_batch(plan: Plan, replica: int) -> int:
    """Global index of the replica's first micro-batch (replicas take consecutive slices)."""
    return sum(r.num_micro_batches for r in plan.replicas[:replica])


def grad_reduce_trigger(actions) -> int | None:
    """Index of the action before which an overlapped gradient synchronizer is armed: the stage's
    last backward. ``_run_actions`` computes weight gradients inside B (its W actions are no-ops),
    so with zero-bubble schedules (B and W split) this is the last B, not the last W."""
    backward = [i for i, a in enumerate(actions) if a.kind in ("B", "BW")]
    return backward[-1] if backward else None


@dataclass
class StageTimes:
    """Where one rank's time went in one iteration."""

    compute_s: float = 0.0  # forward + backward compute (including emulated slowdown)
    emulated_s: float = 0.0  # added waiting to emulate a slower device (in compute_s, plus the optimizer step's)
    total_s: float = 0.0  # the whole iteration

    @property
    def idle_s(self) -> float:
        return max(0.0, self.total_s - self.compute_s)


@dataclass(frozen=True, kw_only=True)
class HeteroIterationLog(IterationLog):
    """IterationLog plus this rank's compute/idle split."""

    compute_s: float = 0.0
    idle_s: float = 0.0
    tokens_per_s: float = 0.0


class TrainerHooks:
    """Optional hook points of HeteroTrainer (fault tolerance plugs in here; defaults do nothing).

    ``run_actions`` may replace the schedule executor for one iteration (return the loss sum) or
    return None to use the plan's schedule; ``on_failure`` may repair the trainer after an exception
    of an iteration and return True to redo that iteration (gradients are zeroed again).
    """

    def on_step_start(self, trainer: HeteroTrainer, iteration: int) -> None:
        return None

    def run_actions(self, trainer: HeteroTrainer, iteration: int, times: StageTimes) -> torch.Tensor | None:
        return None

    def on_action(self, trainer: HeteroTrainer, iteration: int, index: int, action) -> None:
        return None

    def on_step_end(self, trainer: HeteroTrainer, log: HeteroIterationLog) -> None:
        return None

    def on_failure(self, trainer: HeteroTrainer, iteration: int, error: BaseException) -> bool:
        return False


class ChainedHooks(TrainerHooks):
    """Several hooks as one (e.g. TensorBoard logging and fault tolerance): every hook sees every
    event in order; the first executor that does not return None runs the iteration; a failure is
    repaired as soon as one hook repairs it."""

    def __init__(self, *hooks: TrainerHooks) -> None:
        self.hooks = tuple(hooks)  # called in this order

    def on_step_start(self, trainer: HeteroTrainer, iteration: int) -> None:
        for h in self.hooks:
            h.on_step_start(trainer, iteration)

    def run_actions(self, trainer: HeteroTrainer, iteration: int, times: StageTimes) -> torch.Tensor | None:
        for h in self.hooks:
            loss = h.run_actions(trainer, iteration, times)
            if loss is not None:
                return loss
        return None

    def on_action(self, trainer: HeteroTrainer, iteration: int, index: int, action) -> None:
        for h in self.hooks:
            h.on_action(trainer, iteration, index, action)

    def on_step_end(self, trainer: HeteroTrainer, log: HeteroIterationLog) -> None:
        for h in self.hooks:
            h.on_step_end(trainer, log)

    def on_failure(self, trainer: HeteroTrainer, iteration: int, error: BaseException) -> bool:
        return any(h.on_failure(trainer, iteration, error) for h in self.hooks)


class HeteroTrainer:
    """Builds this rank's stage from a plan and trains it. Call the constructor on every rank."""

    def __init__(self, *, model: ModelSpec, plan: Plan, train: TrainConfig, batch_fn: BatchFn,
                 cluster: ClusterSpec | None = None, init_full_state: Mapping[str, torch.Tensor] | None = None,
                 padded_vocab: int | None = None, slowdown: float | None = None,
                 hooks: TrainerHooks | None = None) -> None:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        check_tp_comm_overlap(plan)
        if plan.micro_batch_size != train.micro_batch_size or plan.global_batch_size != train.global_batch_size:
            raise ValueError(
                f"batch sizes: the plan has micro {plan.micro_batch_size} / global {plan.global_batch_size}, the "
                f"training arguments micro {train.micro_batch_size} / global {train.global_batch_size}. "
                f"Fix: pass the plan's sizes (or re-plan for yours)")
        self.model_spec, self.plan, self.train, self.batch_fn = model, plan, train, batch_fn
        self.hooks = hooks  # None: plain training, an exception ends the run
        self.pgc, self.role = build_stage_groups(plan)
        role = self.role
        self.replica = plan.replicas[role.replica]
        self.stage_plan = self.replica.stages[role.stage]
        self.is_first, self.is_last = role.is_first_stage, role.is_last_stage
        self.slowdown = slowdown if slowdown is not None else (
            cluster.slowdown(role.island) if cluster is not None and cluster.emulated else 1.0)

        torch.manual_seed(train.seed + role.layers[0])
        model_parallel_cuda_manual_seed(train.seed + role.layers[0], tp_rank=role.tp_rank, ep_rank=0, etp_rank=0,
                                        force_reset_rng=True)
        self.stage = StageModelSpec(model=model, num_layers=role.layers[1] - role.layers[0],
                                    layer_offset=role.layers[0], tp=role.tp_size, pre_process=self.is_first,
                                    post_process=self.is_last, vocab_size=padded_vocab or plan_padded_vocab(model, plan),
                                    recompute=self.stage_plan.recompute, sequence_parallel=plan.sequence_parallel)
        self.config = transformer_config(self.stage)
        self.gpt = build_gpt_stage(self.stage, self.config, self.pgc)
        self.tied = not model.untie_embeddings_and_output_weights
        if init_full_state is not None:
            load_full_state(self.gpt, init_full_state, layer_offset=role.layers[0], tp_rank=role.tp_rank,
                            tp_size=role.tp_size, tied=self.tied, gated=model.swiglu)
        self.overlap_report = None  # comm.overlap_megatron.OverlapReport when the stage overlaps
        if self.stage_plan.tp_comm_overlap:
            from megatron_het.comm.overlap_megatron import apply_tp_comm_overlap

            self.overlap_report = apply_tp_comm_overlap(self.gpt, chunks=train.tp_comm_overlap_chunks)
            if role.tp_rank == 0:
                logger.info("rank %d (replica %d stage %d): %s", role.rank, role.replica, role.stage,
                            self.overlap_report.describe())

        stages = self.replica.stages
        prev = Neighbour(ranks=tuple(stages[role.stage - 1].ranks)) if role.stage > 0 else None
        nxt = Neighbour(ranks=tuple(stages[role.stage + 1].ranks)) if role.stage + 1 < len(stages) else None
        self.link = BoundaryLink(tp_rank=role.tp_rank, tp=role.tp_size, prev=prev, next=nxt,
                                 sequence_parallel=plan.sequence_parallel)
        self.schedule = build_schedule(plan.schedule, len(stages), self.replica.num_micro_batches,
                                       plan.virtual_pipeline_size)
        self.actions = self.schedule.actions[role.stage]
        self.total_micro_batches = sum(r.num_micro_batches for r in plan.replicas)

        self.params = self._named_global_params()
        self.placement = rank_placement(plan, cluster)
        self.sync = self._gradient_synchronizer()
        if init_full_state is None:  # stages are seeded apart: every copy of a parameter starts from one value
            self.sync.synchronize_values()
        for ranks, kind in self.sync.routes:
            if kind != "native":
                logger.info("rank %d: gradient group %s spans collective libraries %s -> %s", role.rank,
                            list(ranks), sorted({self.placement.library[r] for r in ranks}), kind)
        decay = [p for n, p in self.params.items() if not (p.dim() == 1 or n.endswith(".bias"))]
        no_decay = [p for n, p in self.params.items() if p.dim() == 1 or n.endswith(".bias")]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)
        self.iteration = 0
        if self.slowdown != 1.0 and dist.get_rank() == role.rank:
            logger.info("rank %d (%s): EMULATED device speed, compute slowed %.2fx", role.rank, role.island,
                        self.slowdown)

    # ---- parameters -------------------------------------------------------------------------
    def _named_global_params(self) -> dict[str, torch.nn.Parameter]:
        out = {}
        for name, p in self.gpt.named_parameters():
            g = global_name(name, self.role.layers[0])
            if self.tied and g == TIED_OUTPUT:
                g = WORD_EMBEDDING  # the last stage's copy of the tied word embedding
            out[g] = p
        return out

    def _gradient_synchronizer(self) -> GradientSynchronizer:
        """The plain synchronizer, or with ``overlap_grad_reduce`` the hook-driven one in buckets of
        ``ddp_bucket_size`` parameters (megatron-core's default size when None)."""
        if not self.train.overlap_grad_reduce:
            return GradientSynchronizer(self._holdings(), self.params, placement=self.placement)
        from megatron_het.comm.overlap_grad import OverlappedGradientSynchronizer
        from megatron_het.perf.predict import bucket_parameters

        size = self.train.ddp_bucket_size or bucket_parameters(len(self.plan.replicas))
        return OverlappedGradientSynchronizer(self._holdings(), self.params, placement=self.placement,
                                              bucket_numel=size)

    def _holdings(self) -> list[Holding]:
        role = self.role
        hs = []
        for name, p in self.params.items():
            dim = int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None
            full = list(p.shape)
            if dim is not None:
                full[dim] *= role.tp_size
            hs.append(Holding(name=name, rank=role.rank, stage_key=(role.replica, role.stage), tp_rank=role.tp_rank,
                              tp_size=role.tp_size, partition_dim=dim, full_shape=tuple(full),
                              glu=is_glu(name, self.model_spec.swiglu),
                              sequence_parallel=bool(self.config.sequence_parallel
                                                     and getattr(p, "sequence_parallel", False))))
        return hs

    # ---- one iteration ----------------------------------------------------------------------
    def _micro_tokens(self, iteration: int, micro_batch: int, batch_fn: BatchFn | None = None) -> torch.Tensor:
        mbs = self.train.micro_batch_size
        first = (replica_first_micro_batch(self.plan, self.role.replica) + micro_batch) * mbs
        return (batch_fn or self.batch_fn)(iteration, range(first, first + mbs))

    @torch.no_grad()
    def evaluate(self, batch_fn: BatchFn, iteration: int) -> float:
        """Forward-only loss of one global batch from ``batch_fn`` (e.g. the validation split)."""
        act_shape = (self.model_spec.seq_length, self.train.micro_batch_size, self.model_spec.hidden_size)
        loss_sum = 0.0
        for m in range(self.replica.num_micro_batches):  # forwards in order: no deadlock, no backward
            tokens = self._micro_tokens(iteration, m, batch_fn) if (self.is_first or self.is_last) else None
            inp = None if self.is_first else self.link.recv_forward(act_shape, self.config.params_dtype, m)
            out = self._forward(tokens, inp)
            if self.is_last:
                loss_sum += float(out) * self.total_micro_batches
            else:
                self.link.send_forward(out, m)
        self.link.drain()
        report = torch.tensor([loss_sum if (self.is_last and self.role.tp_rank == 0) else 0.0])
        dist.all_reduce(report)
        return float(report) / self.total_micro_batches

    def _timed(self, times: StageTimes, fn):
        start = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - start
        if self.slowdown > 1.0:  # emulate a slower device: wait the extra time it would take
            extra = (self.slowdown - 1.0) * dt
            time.sleep(extra)
            times.emulated_s += extra
            dt += extra
        times.compute_s += dt
        return out

    def train_step(self) -> HeteroIterationLog:
        while True:
            it = self.iteration
            if self.hooks is not None:
                self.hooks.on_step_start(self, it)
            try:
                log = self._step(it)
            except Exception as error:  # a peer failed: the hooks may repair the groups and redo
                if self.hooks is None or not self.hooks.on_failure(self, it, error):
                    raise
                continue
            if self.hooks is not None:
                self.hooks.on_step_end(self, log)
            return log

    def _step(self, it: int) -> HeteroIterationLog:
        start = time.perf_counter()
        times = StageTimes()
        for group in self.optimizer.param_groups:
            group["lr"] = self.train.lr_at(it)
        self.optimizer.zero_grad(set_to_none=False)
        for p in self.params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        loss_sum = self.hooks.run_actions(self, it, times) if self.hooks is not None else None
        if loss_sum is None:
            loss_sum = self._run_actions(it, times)
        self.sync.reduce()
        grad_norm = self._clip()
        # Global mean loss: last stages hold their replicas' per-micro-batch mean sums. Reported
        # before the step so that a failure in any collective leaves every survivor un-stepped.
        report = torch.tensor([loss_sum.item() if (self.is_last and self.role.tp_rank == 0) else 0.0])
        dist.all_reduce(report)
        step_start = time.perf_counter()
        self.optimizer.step()
        if self.slowdown > 1.0:  # a slower device steps its optimizer slower too (the model prices it so)
            extra = (self.slowdown - 1.0) * (time.perf_counter() - step_start)
            time.sleep(extra)
            times.emulated_s += extra
        times.total_s = time.perf_counter() - start
        self.iteration += 1
        tokens = self.train.global_batch_size * self.model_spec.seq_length
        return HeteroIterationLog(iteration=self.iteration, lm_loss=float(report) / self.total_micro_batches,
                                  grad_norm=grad_norm, elapsed_s=times.total_s, compute_s=times.compute_s,
                                  idle_s=times.idle_s, tokens_per_s=tokens / times.total_s)

    def _run_actions(self, it: int, times: StageTimes) -> torch.Tensor:
        """Run this stage's action list of the plan's schedule; returns the local loss sum."""
        mbs, seq, h = self.train.micro_batch_size, self.model_spec.seq_length, self.model_spec.hidden_size
        act_shape = (seq, mbs, h)
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        loss_sum = torch.zeros((), dtype=torch.float64)
        trigger = grad_reduce_trigger(self.actions) if hasattr(self.sync, "arm") else None
        for index, action in enumerate(self.actions):
            if self.hooks is not None:
                self.hooks.on_action(self, it, index, action)
            m = action.micro_batch
            if action.kind == "F":
                tokens = self._micro_tokens(it, m) if (self.is_first or self.is_last) else None
                inp = None
                if not self.is_first:
                    inp = self.link.recv_forward(act_shape, self.config.params_dtype, m).requires_grad_()
                out = self._timed(times, lambda: self._forward(tokens, inp))
                if self.is_last:
                    loss_sum += float(out.detach()) * self.total_micro_batches
                else:
                    self.link.send_forward(out.detach(), m)
                saved[m] = (inp, out)
            elif action.kind in ("B", "BW"):
                inp, out = saved.pop(m)
                grad = None if self.is_last else self.link.recv_backward(act_shape, out.dtype, m)
                if index == trigger:  # buckets start reducing as this backward completes them
                    self.sync.arm()
                self._timed(times, lambda: torch.autograd.backward(out, grad_tensors=grad))
                if not self.is_first:
                    self.link.send_backward(inp.grad, m)
            elif action.kind == "W":
                continue  # fused into B here: torch autograd computes both gradients together
            else:
                raise ValueError(f"unknown schedule action {action}")
        self.link.drain()
        return loss_sum

    def _forward(self, tokens: torch.Tensor | None, inp: torch.Tensor | None) -> torch.Tensor:
        if inp is not None:
            self.gpt.set_input_tensor(inp)
        inputs = labels = position_ids = None
        if tokens is not None:
            inputs, labels, position_ids, _ = split_tokens(tokens)
        if position_ids is None:
            mbs, seq = self.train.micro_batch_size, self.model_spec.seq_length
            position_ids = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
        out = self.gpt(inputs if self.is_first else None, position_ids, None,
                       labels=labels if self.is_last else None)
        if self.is_last:
            # out: per-token losses [b, s]; this micro-batch's share of the global-batch mean.
            return out.float().mean() / self.total_micro_batches
        return out

    def _clip(self) -> float:
        sq = self.sync.grad_norm_sq_local()
        dist.all_reduce(sq)
        norm = math.sqrt(float(sq))
        if self.train.clip_grad > 0:
            coeff = self.train.clip_grad / (norm + 1e-6)
            if coeff < 1.0:
                for p in self.params.values():
                    p.grad.mul_(coeff)
        return norm

    # ---- checkpoints ------------------------------------------------------------------------
    def _slots(self):
        from megatron_het.checkpoint.dist_ckpt import TensorSlot

        return {name: TensorSlot(tensor=p.detach(), partition_dim=self.sync.local[name].partition_dim,
                                 tp_rank=self.role.tp_rank, tp_size=self.role.tp_size,
                                 main=(name, self.role.rank) in self.sync.owned,
                                 glu=is_glu(name, self.model_spec.swiglu))
                for name, p in self.params.items()}

    def save_checkpoint(self, save: str) -> str:
        """Write model, optimizer, iteration and data position under ``save`` (collective)."""
        from megatron_het.checkpoint.dist_ckpt import model_common_state, save_checkpoint

        moments = {}
        for name, p in self.params.items():
            st = self.optimizer.state.get(p, {})
            moments[name] = {k: st.get(k, torch.zeros_like(p)).detach() for k in ("exp_avg", "exp_avg_sq")}
        common = {"model": model_common_state(self.model_spec), "padded_vocab": self.stage.vocab_size,
                  "consumed_samples": self.iteration * self.train.global_batch_size,
                  "plan": self.plan.to_dict(), "seed": self.train.seed}
        return save_checkpoint(save, self.iteration, params=self._slots(), optimizer_state=moments, common=common)

    @torch.no_grad()
    def load_checkpoint(self, path: str, *, with_optimizer: bool = True) -> int:
        """Load a checkpoint written under any plan; returns its iteration (collective)."""
        from megatron_het.checkpoint.dist_ckpt import CheckpointError, load_checkpoint

        common, values, moments = load_checkpoint(path, params=self._slots(), model=self.model_spec,
                                                  with_optimizer=with_optimizer)
        if common.get("padded_vocab") != self.stage.vocab_size:
            raise CheckpointError(
                f"{path}: padded_vocab: the checkpoint has {common.get('padded_vocab')} embedding rows, this plan "
                f"builds {self.stage.vocab_size}. Fix: construct the trainer with padded_vocab="
                f"{common.get('padded_vocab')} (pretrain_gpt.py does this when --load is given)")
        iteration = int(common["iteration"])
        for name, p in self.params.items():
            p.copy_(values[name])
            if with_optimizer:
                self.optimizer.state[p] = {"step": torch.tensor(float(iteration)),
                                           "exp_avg": moments[name]["exp_avg"].clone(),
                                           "exp_avg_sq": moments[name]["exp_avg_sq"].clone()}
        self.iteration = iteration
        return iteration

    # ---- whole runs -------------------------------------------------------------------------
    def shards(self) -> dict[str, Shard]:
        return local_shards(self.gpt, layer_offset=self.role.layers[0], tp_rank=self.role.tp_rank,
                            tp_size=self.role.tp_size, tied=self.tied, gated=self.model_spec.swiglu)

    def run(self, iterations: int | None = None, *, return_shards: bool = False,
            on_iteration: Callable[[HeteroIterationLog], None] | None = None) -> RunResult:
        """Train ``iterations`` steps (default ``train.train_iters``), logging each."""
        initial = self.shards() if return_shards else None
        logs = []
        for _ in range(iterations if iterations is not None else self.train.train_iters):
            log = self.train_step()
            logs.append(log)
            if on_iteration is not None:
                on_iteration(log)
        return RunResult(rank=self.role.rank, iterations=tuple(logs), initial_shards=initial,
                         shards=self.shards() if return_shards else None)
