"""Pipeline strategy: one GPT under a heterogeneous Plan (uneven TP/PP per device type, uneven micro-batches).

One rank = one place in the plan (replica, stage, TP rank). The stage's model is a megatron-core
GPTModel holding the stage's layers, built with the stage's own process groups. Each iteration the
rank runs its stage's action list of the plan's schedule (``executor.py``; the same data the
performance model simulates), moving activations/gradients to neighbour stages of any TP size
(``boundary.py``), then gradients are summed over every holder of each full parameter
(``grad_sync.py``), clipped by the global norm and applied by AdamW with Megatron's weight-decay
groups. Each micro-batch's loss is divided by the *global* micro-batch count, so the sum over
replicas of different sizes is the mean gradient over the whole global batch.

Overlap options (docs/overlap.md): the plan's ``sequence_parallel`` shards activations along the
sequence inside each TP group (boundaries re-split them between TP sizes); a stage whose plan sets
``tp_comm_overlap`` switches its TP linears to the chunked collective/GEMM path
(``comm/overlap_megatron.py``); ``TrainConfig.overlap_grad_reduce`` launches the cross-replica
gradient buckets from gradient hooks during each stage's last backward (``runtime/overlap_grad.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence

import torch

from megatron_het.checkpoint.full_state import (
    Shard,
    load_full_state,
    load_grid_full_state,
    local_grid_shards,
    local_shards,
)
from megatron_het.checkpoint.tp_layout import is_glu
from megatron_het.cluster import ClusterSpec, ConfigError, ModelSpec
from megatron_het.model.gpt import build_gpt_stage, transformer_config
from megatron_het.model.tp3d_stage import build_tp3d_gpt_stage
from megatron_het.plan import Plan, chunk_layers
from megatron_het.plan.validate import check_runtime_tp_grid, check_schedule, check_tp_comm_overlap
from megatron_het.platform import Accelerator, detect_accelerator
from megatron_het.platform.allocation_peak import phase
from megatron_het.runtime.boundary import BoundaryLink, Neighbour
from megatron_het.runtime.boundary_groups import (
    create_boundary_groups,
    group_with,
    plan_boundaries,
    plan_boundary_keys,
)
from megatron_het.runtime.comm_routing import (
    RankPlacement,
    all_reduce_world,
    new_bridge_group,
    path_counts,
    rank_placement,
)
from megatron_het.runtime.executor import ActionExecutor, globalise
from megatron_het.runtime.grad_sync import GradientSynchronizer, Holding
from megatron_het.runtime.group_ledger import GroupLedger
from megatron_het.runtime.holdings import (
    chunk_model_specs,
    global_params,
    plan_padded_vocab,
    stage_holdings,
    stage_model_spec,
)
from megatron_het.runtime.initial_values import SeededFullState, load_seeded
from megatron_het.runtime.megatron_trainer import split_tokens
from megatron_het.runtime.mixed_precision import LossScaler, MainParams, params_dtype, wrap_float16
from megatron_het.runtime.moe_aux_loss import set_aux_loss_scale
from megatron_het.runtime.moe_metrics import MoEMetrics
from megatron_het.runtime.split_backward import WeightGradStore, install_split_linears, unsplit_linears
from megatron_het.runtime.stage_groups import build_stage_groups, plan_expert_layouts_of
from megatron_het.schedule import Action, build_schedule
from megatron_het.schedule.stream_model import check_transfer_streams
from megatron_het.schedule.transfers import Step, stage_transfer_steps
from megatron_het.train.config import TrainConfig
from megatron_het.train.data_position import DataPosition, position_from_checkpoint, positioned_batches
from megatron_het.train.lr_schedule import decoupled_lr_at, is_decoupled
from megatron_het.train.strategy import ActionHook, BatchFn, IterationLog, StepResult
from megatron_het.train.timer import EmulationTimer, emulation_timer
from megatron_het.train.trainer import Trainer, TrainerHooks
from megatron_het.utils.eval_mode import eval_mode

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def only_layers(decoder, window: tuple[int, int] | None):
    """Inside: megatron-core's TransformerBlock runs only its layers ``[first, stop)`` (local indices),
    the others are skipped for this forward (and so have no gradient from it). None: all layers."""
    if window is None:
        yield
        return
    layers = decoder._modules["layers"]
    decoder._modules["layers"] = torch.nn.ModuleList(list(layers)[window[0]:window[1]])
    try:
        yield
    finally:
        decoder._modules["layers"] = layers


def replica_first_micro_batch(plan: Plan, replica: int) -> int:
    """Global index of the replica's first micro-batch (replicas take consecutive slices)."""
    return sum(r.num_micro_batches for r in plan.replicas[:replica])


class PipelineStrategy:
    """This rank's stage of a plan: model, groups, gradient synchronizer, optimizer, schedule executor."""

    reports_shards = True  # every rank returns its own shards (pieces of different stages and TP ranks)

    def __init__(self, *, model: ModelSpec, plan: Plan, train: TrainConfig, batch_fn: BatchFn,
                 cluster: ClusterSpec | None = None, init_full_state: Mapping[str, torch.Tensor] | None = None,
                 padded_vocab: int | None = None, accelerator: Accelerator | None = None) -> None:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        check_tp_comm_overlap(plan)
        check_runtime_tp_grid(plan)  # what a 3D TP stage cannot run yet (#20): refused, never run as 1D
        check_schedule(plan, model)  # never run a schedule / virtual size the executor does not implement
        if plan.micro_batch_size != train.micro_batch_size or plan.global_batch_size != train.global_batch_size:
            raise ConfigError(f"the plan has micro {plan.micro_batch_size} / global {plan.global_batch_size}",
                              field="--micro-batch-size / --global-batch-size",
                              value=(train.micro_batch_size, train.global_batch_size),
                              fix="pass the plan's sizes (or re-plan for yours)")
        self.model_spec, self.plan, self.train, self.batch_fn = model, plan, train, batch_fn
        self.data_position = DataPosition()  # fresh run; load_checkpoint resumes the checkpoint's (train/data_position.py)
        # device, backends, timing and memory of this rank (platform/): every tensor and group below uses it
        self.accelerator = acc = accelerator or detect_accelerator()
        self.device = acc.device
        acc.set_device()
        placement = rank_placement(plan, cluster)
        island_library = {placement.island[r]: placement.library[r] for r in placement.island}
        self.groups = GroupLedger()  # every group built below, destroyed by close()
        self.pgc, self.role = build_stage_groups(plan, timeout=train.group_timeout, device_id=acc.eager_device,
                                                 backend_of=lambda island: acc.backend_for(island_library[island]),
                                                 library_of=island_library.get)
        role = self.role
        self.grid_groups = self._grid_groups()  # 3D tensor-parallel stage (plan tp_grid), else None
        self.replica = plan.replicas[role.replica]
        self.stage_plan = self.replica.stages[role.stage]
        self.is_first, self.is_last = role.is_first_stage, role.is_last_stage

        torch.manual_seed(train.seed + role.layers[0])
        # MoE: this rank's place in its stage's expert grid (plan/experts.py; None for a dense model)
        self.experts = plan_expert_layouts_of(plan, model.num_experts)[role.rank] if model.is_moe else None
        ex = self.experts
        model_parallel_cuda_manual_seed(train.seed + role.layers[0], tp_rank=role.tp_rank,
                                        ep_rank=ex.ep_rank if ex else 0, etp_rank=ex.etp_rank if ex else 0,
                                        force_reset_rng=True)
        # a 3D stage runs megatron-core at TP = gy without sequence parallelism: its boundaries hold the
        # whole sequence (full_sequence)
        self.stage = stage_model_spec(model, plan, self.stage_plan, is_first=self.is_first, is_last=self.is_last,
                                      vocab_size=padded_vocab or plan_padded_vocab(model, plan),
                                      params_dtype=params_dtype(train.precision), transformer_impl=train.transformer_impl,
                                      deterministic=train.deterministic_mode)
        # no values drawn at construction: every one comes from init_values below (or a checkpoint's)
        self.config = transformer_config(self.stage, cpu_initialization=not acc.is_gpu, initialize=False)
        self.tied = not model.untie_embeddings_and_output_weights
        self.overlap_report = None  # comm.overlap_megatron.OverlapReport when the stage overlaps
        # model chunks (virtual pipeline size V): chunk c holds layers chunk_ranges[c] (the plan's, uneven
        # where devices differ); V = 1: one chunk, the stage's own range
        self.num_chunks = plan.virtual_pipeline_size
        self.chunk_ranges = chunk_layers(self.replica, self.num_chunks)[role.stage]
        # linears' deferred weight gradients when the schedule splits B and W (runtime/split_backward.py)
        self.wgrad_store = WeightGradStore()
        self.layer_window: tuple[int, int] | None = None  # local decoder layers the next forward runs (None: all)
        self.staggered_step = False  # step right after this stage's own gradient reduction (needs clip_grad 0)
        self.gpt = self._build_model()
        self.params = self.named_global_params()
        if init_full_state is None:
            # a fresh run: this rank's pieces of one seeded full model, the same under every plan
            # (runtime/initial_values.py), so every holder of a parameter starts with the same value
            load_seeded(self.params, self.holdings(), SeededFullState(model, seed=train.seed,
                                                                       padded_vocab=self.stage.vocab_size))
        elif self.grid_groups is not None:  # 3D stages have one chunk
            load_grid_full_state(self.gpt, init_full_state, layer_offset=role.layers[0],
                                 grid=self.stage_plan.tp_grid, grid_rank=role.tp_rank, tied=self.tied)
        else:
            for gpt, (first, _) in zip(self.gpts, self.chunk_ranges):
                load_full_state(gpt, init_full_state, layer_offset=first, tp_rank=role.tp_rank,
                                tp_size=role.tp_size, tied=self.tied, gated=model.swiglu, experts=self.experts)
        if self.overlap_report is not None and role.tp_rank == 0:
            logger.info("rank %d (replica %d stage %d): %s", role.rank, role.replica, role.stage,
                        self.overlap_report.describe())
        self.total_micro_batches = sum(r.num_micro_batches for r in plan.replicas)
        # MoE routers' losses for the log line (renumbered with their global layers)
        self.moe_metrics = (MoEMetrics(model, list(zip(self.gpts, (first for first, _ in self.chunk_ranges))),
                                       tp_size=role.tp_size, device=self.device) if model.is_moe else None)

        # mixed precision: fp32 main parameters/gradients the synchronizer, norm and optimizer use (the
        # distributed optimizer's fp32 gradients only, made with it: no full fp32 copy, not even briefly)
        mixed = train.precision != "fp32"
        self.main = MainParams(self.params) if mixed and not plan.use_distributed_optimizer else None
        self.scaler = LossScaler(train, self.device) if train.fp16 else None
        self.plan_rank = role.rank  # this rank in ``plan`` (role.rank changes when the world is rebuilt)
        self.plan_placement = self.placement = placement
        self.sync = self._gradient_synchronizer()
        for ranks, kind in self.sync.routes:
            if kind != "native":
                logger.info("rank %d: gradient group %s spans collective libraries %s -> %s", role.rank,
                            list(ranks), sorted({self.placement.library[r] for r in ranks}), kind)
        self.optimizer = self._optimizer()

        stages = self.replica.stages
        bridges = self._boundary_bridges()
        boundary_groups = create_boundary_groups(plan_boundary_keys(plan),
                                                 spans_libraries=self.plan_placement.spans_libraries,
                                                 backend=acc.torch_backend, timeout=self.train.group_timeout,
                                                 device_id=acc.eager_device)
        mine = tuple(self.stage_plan.ranks)
        self.paths = self._communication_paths()
        if role.rank == 0:
            logger.info("communication paths: %s", "; ".join(
                f"{kind}: {c['native']} native ({acc.torch_backend}), {c['het-bridge']} het-bridge"
                for kind, c in self.paths.items()))

        def neighbour(s: int) -> Neighbour | None:  # island and stage are named when a transfer fails
            if not 0 <= s < len(stages):
                return None
            return Neighbour(ranks=tuple(stages[s].ranks), island=stages[s].island, stage=s,
                             bridge=bridges.get((role.replica, min(s, role.stage))),
                             full_sequence=stages[s].tp_grid is not None,
                             **group_with(stages[s].ranks, mine, boundary_groups))

        p, v = len(stages), self.num_chunks

        def chunk_link(c: int) -> BoundaryLink:
            """Chunk c's neighbours: virtual stages c*p + s -/+ 1 (stage 0's chunk c > 0 follows the last
            stage's chunk c - 1; the last stage's chunk c < V - 1 feeds stage 0's chunk c + 1)."""
            prev = neighbour(role.stage - 1) if role.stage > 0 else (wrap(p - 1) if c > 0 else None)
            nxt = neighbour(role.stage + 1) if role.stage < p - 1 else (wrap(0) if c < v - 1 else None)
            return BoundaryLink(tp_rank=role.tp_rank, tp=role.tp_size, prev=prev, next=nxt,
                                sequence_parallel=plan.sequence_parallel, full_sequence=self.grid_groups is not None,
                                device=self.device)

        def wrap(s: int) -> Neighbour:  # the last stage <-> stage 0 boundary of interleaving
            return Neighbour(ranks=tuple(stages[s].ranks), island=stages[s].island, stage=s,
                             bridge=bridges.get((role.replica, p - 1)), **group_with(stages[s].ranks, mine, boundary_groups))

        link = chunk_link(0)
        schedule = build_schedule(plan.schedule, len(stages), self.replica.num_micro_batches,
                                  plan.virtual_pipeline_size)
        check_transfer_streams(schedule, tags=acc.p2p_tags, backend=acc.torch_backend)
        if schedule.split_backward and self.unsplit_linears:
            logger.warning("rank %d: %s defers the weight gradients of megatron-core's local linears only; %d "
                           "linears of this stage (e.g. %s: transformer-engine's, or TP-overlap ones) keep theirs "
                           "in B, so W is smaller than the plan was priced with. Fix: --transformer-impl local for "
                           "transformer-engine's (TP-overlap linears always keep theirs), or schedule 1f1b",
                           role.rank, plan.schedule, len(self.unsplit_linears), self.unsplit_linears[0])
        first = replica_first_micro_batch(plan, role.replica)
        self.executor = self._executor(globalise(schedule.actions[role.stage], first),
                                       dict.fromkeys(range(first, first + self.replica.num_micro_batches), link),
                                       split_backward=schedule.split_backward,
                                       chunk_links={c: chunk_link(c) for c in range(1, v)},
                                       steps=stage_transfer_steps(schedule, role.stage))
        self.groups.seal()

    @property
    def rank(self) -> int:
        return self.role.rank

    def close(self) -> None:
        """Destroy the process groups this strategy created (their gloo threads and connections end with
        them); the strategy cannot step afterwards. Every rank calls it, like the constructor."""
        self.groups.destroy()

    def _grid_groups(self):
        """A 3D stage's axis groups (collective over the world, every plan's 3D stages) and its
        megatron-core collection at TP = gy in ``self.pgc``; None on a 1D stage."""
        from megatron_het.runtime.tp3d_groups import create_plan_grid_groups, grid_pg_collection

        groups = create_plan_grid_groups(self.plan, timeout=self.train.group_timeout)
        if groups is not None:
            self.pgc = grid_pg_collection(self.pgc, groups)
        return groups

    def _boundary_bridges(self) -> dict:
        """(replica, upstream stage) -> het bridge group of that boundary, for the boundaries whose two
        stages use different collective libraries and that this rank is part of. Collective: every
        rank creates every bridged boundary's group, in plan order."""
        out = {}
        for r, s, up, down in plan_boundaries(self.plan):  # interleaving's wrap boundary keyed (replica, p - 1)
            ranks = sorted({*up, *down})
            if not self.plan_placement.spans_libraries(ranks):
                continue
            group = new_bridge_group(ranks, self.plan_placement, accelerator=self.accelerator,
                                     timeout=self.train.group_timeout)
            if group is not None:
                out[(r, s)] = group
        self.boundary_bridges = out
        return out

    def _communication_paths(self) -> dict[str, dict[str, int]]:
        """Per group kind of the whole plan: how many groups are native and how many bridged (pure)."""
        stage_groups = [tuple(st.ranks) for rep in self.plan.replicas for st in rep.stages]
        boundaries = [sorted({*rep.stages[s].ranks, *rep.stages[s + 1].ranks})
                      for rep in self.plan.replicas for s in range(len(rep.stages) - 1)]
        gradient = [b.ranks for b in self.sync.buckets]
        return {"stage (TP) groups": path_counts(stage_groups, self.plan_placement),
                "pipeline boundaries": path_counts(boundaries, self.plan_placement),
                "gradient groups": path_counts(gradient, self.plan_placement)}

    # ---- building blocks (also used by rebind) -----------------------------------------------
    @property
    def opt_params(self) -> dict[str, torch.nn.Parameter]:
        """What the synchronizer, norm, optimizer and checkpoints see: fp32 main parameters in mixed
        precision, else the model's own parameters."""
        return self.main.main if self.main is not None else self.params

    def _build_model(self):
        """Every model chunk (``self.gpts``, wrapped: ``self.modules``); returns chunk 0 (``self.gpt``)."""
        self.gpts, self.modules = [], []
        self.unsplit_linears: list[str] = []  # linears whose W a split-backward schedule cannot defer
        v = self.num_chunks
        for spec in chunk_model_specs(self.stage, self.chunk_ranges):
            config = self.config if v == 1 else transformer_config(spec, cpu_initialization=not self.accelerator.is_gpu,
                                                                   initialize=False)
            if self.grid_groups is not None:  # a 3D stage (check_runtime_tp_grid: one chunk only)
                gpt = build_tp3d_gpt_stage(spec, config, self.pgc, self.grid_groups,
                                           micro_batch_size=self.train.micro_batch_size, device=self.device)
            else:
                gpt = build_gpt_stage(spec, config, self.pgc, device=self.device)
            # Megatron's Float16Module: converts the stage to bf16/fp16 in place; runs it in that precision
            module = wrap_float16(config, gpt) if self.train.precision != "fp32" else gpt
            if self.stage_plan.tp_comm_overlap:
                from megatron_het.comm.overlap_megatron import apply_tp_comm_overlap

                self.overlap_report = apply_tp_comm_overlap(gpt, chunks=self.train.tp_comm_overlap_chunks)
            routed = install_split_linears(gpt, self.wgrad_store)  # used only while the schedule splits B and W
            self.unsplit_linears += unsplit_linears(gpt, routed)
            self.gpts.append(gpt)
            self.modules.append(module)
        self.module = self.modules[0]
        return self.gpts[0]

    def _distributed_optimizer(self, groups):
        """fp32 main values and Adam moments sharded over every parameter's holders, in proportion to
        each rank's free memory (``perf.memory.optimizer_shard_weights``); in mixed precision the
        model keeps fp32 main gradients only (``MainGrads``), no full fp32 parameter copy."""
        from megatron_het.optim.distributed import DistributedOptimizer
        from megatron_het.perf.memory import optimizer_shard_weights
        from megatron_het.runtime.grad_sync import owned_norm_holdings
        from megatron_het.runtime.mixed_precision import MainGrads

        train = self.train
        if train.precision != "fp32":  # no full fp32 copy: the optimizer keeps main values as shards
            self.main = MainGrads(self.params)
        # --overlap-grad-reduce (or a plan recording it, which perf.predict prices with the updated
        # weights' gather hidden in the next forward, hence --overlap-param-gather too)
        overlap = train.overlap_grad_reduce or self.plan.overlap_grad_reduce
        # registered after MainGrads' hooks: a bucket fires once its fp32 main gradients are complete
        reducer = (self._overlapped_synchronizer(self.params, groups, grads=self.main.grads if self.main is not None
                                                 else None)
                   if overlap else None)
        weights = optimizer_shard_weights(self.model_spec, self.plan, precision=train.precision)
        gather_overlap = train.overlap_param_gather or self.plan.overlap_grad_reduce
        return DistributedOptimizer(
            self.holdings(), self.params, train=train, device=self.device, owned=owned_norm_holdings,
            main_grads=self.main.grads if self.main is not None else None, weights=weights,
            # every model chunk's sub-modules finish their gathers (interleaved: several chunks)
            overlap_param_gather_in=torch.nn.ModuleList(self.gpts) if gather_overlap else None,
            new_group=groups, reducer=reducer,
            bucket_numel=self._bucket_numel())

    def _optimizer(self) -> torch.optim.AdamW:
        """AdamW with Megatron-LM's groups: no weight decay on biases and 1-D parameters (with the
        distributed optimizer: the synchronizer, which also steps the shards)."""
        if self.plan.use_distributed_optimizer:
            return self.sync
        train = self.train
        groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}  # (decays, decoupled) -> parameters
        for n, p in self.opt_params.items():
            key = (not (p.dim() == 1 or n.endswith(".bias")), train.decoupled_lr is not None and is_decoupled(n))
            groups.setdefault(key, []).append(p)
        return torch.optim.AdamW(
            [{"params": ps, "weight_decay": train.weight_decay if wd else 0.0, "decoupled": dec}
             for (wd, dec), ps in sorted(groups.items(), reverse=True)],
            lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)

    def _executor(self, actions: Sequence[Action], links: Mapping[int, BoundaryLink], *,
                  split_backward: bool, chunk_links: Mapping[int, BoundaryLink] | None = None,
                  steps: Sequence[Step]) -> ActionExecutor:
        mbs, seq, h = self.train.micro_batch_size, self.model_spec.seq_length, self.model_spec.hidden_size
        return ActionExecutor(actions=actions, links=links, is_first=self.is_first, is_last=self.is_last,
                              act_shape=(seq, mbs, h), dtype=self.config.params_dtype, micro_batch_size=mbs,
                              loss_scale=self.total_micro_batches, split_backward=split_backward,
                              arm=getattr(self.sync, "arm", None), device=self.device, store=self.wgrad_store,
                              num_chunks=self.num_chunks, chunk_links=chunk_links, steps=steps)

    def named_global_params(self) -> dict[str, torch.nn.Parameter]:
        """This stage's parameters by global name (the last stage's tied output is the word embedding)."""
        return global_params([(gpt, first) for gpt, (first, _) in zip(self.gpts, self.chunk_ranges)], tied=self.tied,
                             first_expert=self.experts.first_expert if self.experts else 0)

    def _gradient_synchronizer(self) -> GradientSynchronizer:
        """The plain synchronizer, or with ``overlap_grad_reduce`` the hook-driven one in buckets of
        ``ddp_bucket_size`` parameters (megatron-core's default size when None), or with the plan's
        ``use_distributed_optimizer`` the sharded optimizer (``optim/distributed.py``), which is
        synchronizer and optimizer in one. Every one of them reduces over one group per distinct
        holder set (``comm_routing.ReductionGroups``), however many buckets share it."""
        from megatron_het.runtime.comm_routing import ReductionGroups

        groups = self.reduction_groups = ReductionGroups(self.placement, accelerator=self.accelerator,
                                                         timeout=self.train.group_timeout)
        if self.plan.use_distributed_optimizer:
            return self._distributed_optimizer(groups)
        if self.train.overlap_param_gather:
            raise ConfigError("the parameter all-gather exists only with the distributed optimizer",
                              field="--overlap-param-gather", value=True,
                              fix="add --use-distributed-optimizer (or set the plan's use_distributed_optimizer)")
        if not (self.train.overlap_grad_reduce or self.plan.overlap_grad_reduce):  # the plan may record it
            # bucketed as the overlapped one: a direct bucket is reduced in place in its gradient buffer,
            # a reshard bucket packed into one flat buffer, so that temporary is a bucket's, not the stage's
            return GradientSynchronizer(self.holdings(), self.opt_params, accelerator=self.accelerator, groups=groups,
                                        bucket_numel=self._bucket_numel())
        # mixed precision: the fp32 main gradients are reduced, bucket by bucket as the half-precision
        # parameters' gradients arrive (MainParams' hooks, registered before these, fill them first)
        return self._overlapped_synchronizer(self.opt_params, groups)

    def _overlapped_synchronizer(self, params, groups, *, grads=None):
        """Bucketed all-reduce launched from the backward's hooks on this stage's parameters, of
        ``params``' gradients (or ``grads``), in buckets of ``ddp_bucket_size`` parameters (megatron-core's
        default size when None)."""
        from megatron_het.runtime.overlap_grad import OverlappedGradientSynchronizer

        chunk_by_id = {id(p): c for c, gpt in enumerate(self.gpts) for p in gpt.parameters()}
        chunk_of = {name: chunk_by_id[id(p)] for name, p in self.params.items()}  # executor arms per chunk
        return OverlappedGradientSynchronizer(self.holdings(), params, hook_params=self.params, grads=grads,
                                              bucket_numel=self._bucket_numel(), accelerator=self.accelerator, groups=groups,
                                              chunk_of=chunk_of)

    def _bucket_numel(self) -> int:
        """Elements per gradient bucket: ``--ddp-bucket-size``, else megatron-core's default."""
        from megatron_het.perf.predict import bucket_parameters

        return self.train.ddp_bucket_size or bucket_parameters(len(self.plan.replicas))

    def holdings(self) -> list[Holding]:
        """What this rank holds of each full parameter (the gradient synchronizer's input;
        ``runtime/holdings.plan_holdings`` gives every rank's without processes)."""
        role = self.role
        return stage_holdings(self.params, rank=role.rank, stage_key=(role.replica, role.stage), tp_rank=role.tp_rank,
                              tp_size=role.tp_size, gated=self.model_spec.swiglu, grid=self.stage_plan.tp_grid,
                              experts=self.experts)

    def check_weights(self, context: str) -> int:
        from megatron_het.runtime.consistency import check_holders_agree

        return check_holders_agree(self.holdings(), self.params, context=context)

    # ---- one iteration ----------------------------------------------------------------------
    def step(self, iteration: int, *, lr: float, timer: EmulationTimer, on_action: ActionHook | None) -> StepResult:
        decoupled_lr = decoupled_lr_at(self.train, iteration)
        for group in self.optimizer.param_groups:
            group["lr"] = decoupled_lr if group.get("decoupled") else lr
            if "decoupled_lr" in group:  # the distributed optimizer: one group, a rate per element
                group["decoupled_lr"] = decoupled_lr
        self.optimizer.zero_grad(set_to_none=False)
        if self.main is not None:
            self.main.zero_grad()
        else:
            for p in self.params.values():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        self.executor.grad_scale = self.scaler.scale if self.scaler is not None else None
        if self.model_spec.is_moe:
            set_aux_loss_scale(grad_scale=self.executor.grad_scale, total_micro_batches=self.total_micro_batches,
                               device=self.device)
            self.moe_metrics.reset()  # a redone iteration (resilience) must not count its failed attempt
        batch_fn = positioned_batches(self.batch_fn, self.data_position, self.train.global_batch_size)
        with phase("forward_backward"):
            loss_sum = self.executor.run(iteration=iteration, batch_fn=batch_fn, forward=self._forward,
                                         params=list(self.params.values()), timer=timer, on_action=on_action)
        with phase("reduce"):
            self.sync.reduce()
        # the loss scale of this step, read at the log interval (the scaler replaces its tensor on update)
        scale = self.scaler.scale.clone() if self.scaler is not None else None
        # fp16: one host read per step (the agreed overflow flag decides whether to step), as Megatron's found_inf
        skipped = self.scaler.unscale_and_check(self._main_grads()) if self.scaler is not None else False
        staggered = self.staggered_step and not skipped
        if staggered:  # ReCycle's staggered step: no world-wide collective before it (hence no clipping)
            if self.train.clip_grad > 0:
                raise ConfigError("the staggered optimizer step cannot wait for the global gradient norm",
                                  field="--clip-grad", value=self.train.clip_grad, fix="use --clip-grad 0")
            self._optimizer_step(timer)
        # Global norm and global mean loss in one world all-reduce, kept on the device (read at the log
        # interval). Before the step, so that a failure in any collective leaves every survivor un-stepped
        # (a staggered step is taken before it: the resilience hooks then undo it on a failure).
        norm, report, moe_sums = self._world_norm_and_loss(loss_sum)
        if not skipped:
            self._clip(norm)
        zeros = self._world_sum(self.sync.grad_zeros_local()) if self.train.log_num_zeros_in_grad else None
        if not skipped and not staggered:
            self._optimizer_step(timer)
        params_norm = self._world_sum(self.sync.param_norm_sq_local()).sqrt() if self.train.log_params_norm else None
        moe_losses = (self.moe_metrics.report(moe_sums, self.total_micro_batches)
                      if self.moe_metrics is not None else None)
        return StepResult(lm_loss=report / self.total_micro_batches, grad_norm=norm if not skipped else math.nan,
                          skipped=skipped, loss_scale=scale, params_norm=params_norm, num_zeros=zeros,
                          moe_losses=moe_losses)

    def _world_sum(self, local: torch.Tensor) -> torch.Tensor:
        """A float64 sum over the world, on the device (read at the log interval)."""
        total = local.reshape(1).double()
        all_reduce_world(total)
        return total[0]

    def _main_grads(self) -> list[torch.Tensor]:
        """This rank's fp32 main gradients as the optimizer will read them: the distributed optimizer's
        reduced pieces, else every main parameter's (reduced) gradient."""
        if self.plan.use_distributed_optimizer:
            return [self.sync.shard_grad]
        return [m.grad for m in self.opt_params.values()]

    @phase("optimizer_step")
    def _optimizer_step(self, timer: EmulationTimer) -> None:
        """A slower device steps its optimizer slower too (priced so: perf.predict's optimizer_step_s x
        slowdown); the distributed optimizer's all-gather of the updated values is communication,
        priced on the links, so only its local update is stretched."""
        if self.plan.use_distributed_optimizer:
            self.optimizer.step(compute=timer.stretch)
        else:
            timer.stretch(self.optimizer.step)
        if self.main is not None:
            timer.stretch(self.main.copy_to_model)  # Megatron's _copy_main_params_to_model_params

    @torch.no_grad()
    def evaluate(self, batch_fn: BatchFn, iteration: int) -> float:
        """Forward-only loss of one global batch from ``batch_fn`` (e.g. the validation split)."""
        with eval_mode(self.modules):  # dropout off, as Megatron-LM's evaluate()
            loss_sum = self.executor.evaluate(iteration=iteration, batch_fn=batch_fn, forward=self._forward)
        return float(self._loss_report(loss_sum)) / self.total_micro_batches

    def _loss_report(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Sum of the last stages' loss sums over the world, on the device (read when logged)."""
        return all_reduce_world(self._my_loss(loss_sum))

    def _my_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global loss sum: its loss sum on a last stage's TP rank 0, else 0."""
        mine = self.is_last and self.role.tp_rank == 0
        return loss_sum.reshape(1) if mine else torch.zeros(1, dtype=loss_sum.dtype, device=self.device)

    def _world_norm_and_loss(self, loss_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(global gradient norm, global loss sum, the MoE routers' loss sums) as device tensors, from one
        world all-reduce."""
        moe = self.moe_metrics.take_local().to(loss_sum.device) if self.moe_metrics is not None else None
        parts = [self.sync.grad_norm_sq_local().reshape(1).double(), self._my_loss(loss_sum).double()]
        both = torch.cat(parts + ([moe] if moe is not None else []))
        all_reduce_world(both)
        return both[0].sqrt(), both[1], both[2:]

    def _forward(self, chunk: int, tokens: torch.Tensor | None, inp: torch.Tensor | None) -> torch.Tensor:
        module, gpt = self.modules[chunk], self.gpts[chunk]
        is_first, is_last = self.is_first and chunk == 0, self.is_last and chunk == self.num_chunks - 1
        if inp is not None:
            module.set_input_tensor(inp)
        inputs = labels = position_ids = None
        if tokens is not None:
            inputs, labels, position_ids, _ = split_tokens(tokens, self.device)
        if position_ids is None:
            mbs, seq = self.train.micro_batch_size, self.model_spec.seq_length
            position_ids = torch.arange(seq, device=self.device).unsqueeze(0).expand(mbs, seq)
        kwargs = {"fp32_output": is_last} if module is not gpt else {}
        with only_layers(gpt.decoder, self.layer_window):  # a resilience cover runs part of the stage
            out = module(inputs if is_first else None, position_ids, None, labels=labels if is_last else None,
                         **kwargs)
        if is_last:
            # out: per-token losses [b, s]; this micro-batch's share of the global-batch mean.
            return out.float().mean() / self.total_micro_batches
        return out

    def _clip(self, norm: torch.Tensor) -> None:
        """Megatron's clip_grad_by_total_norm_fp32 without reading the norm on the host: the
        coefficient min(1, clip / (norm + 1e-6)) scales the gradients on the device (x 1.0 is exact)."""
        if self.train.clip_grad > 0:
            self.sync.scale_grads((self.train.clip_grad / (norm + 1e-6)).clamp(max=1.0))

    # ---- after a group change (resilience) -----------------------------------------------------
    def rebind(self, *, pgc, ranks: Mapping[int, int], actions: Sequence[Action],
               links: Mapping[int, BoundaryLink], split_backward: bool, steps: Sequence[Step]) -> None:
        """Move this stage onto rebuilt process groups (collective over the new world).

        ``pgc``: this rank's groups in the new world; ``ranks``: rank in the plan -> rank in the new
        world, of every survivor. The stage model is rebuilt on ``pgc`` (with TP overlap when the plan chose it) with
        the same parameter values and optimizer state; gradient synchronisation is rebuilt as at
        construction (overlapped buckets, collective-library placement) over the new ranks; from
        then on ``actions`` (global micro-batches, each sent through ``links[g]``) run each iteration,
        their transfers posted as ``steps`` say (``resilience.routed_transfers``).
        """
        if self.grid_groups is not None:  # the grid groups would have to be rebuilt too
            raise ConfigError("a 3D tensor-parallel stage (tp_grid) cannot be moved onto rebuilt groups yet (#20)",
                              field="tp_grid", value=list(self.stage_plan.tp_grid),
                              fix="run resilience with 1D stages (remove tp_grid)")
        states = [gpt.state_dict() for gpt in self.gpts]
        opt_state = self.optimizer.state_dict()
        self.pgc = pgc
        self.gpt = self._build_model()
        for gpt, state in zip(self.gpts, states):
            gpt.load_state_dict(state)
        if self.moe_metrics is not None:
            self.moe_metrics.renumber(list(zip(self.gpts, (first for first, _ in self.chunk_ranges))))
        self.role = dataclasses.replace(self.role, rank=ranks[self.plan_rank])
        old = self.plan_placement
        self.placement = RankPlacement(island={ranks[r]: i for r, i in old.island.items() if r in ranks},
                                       library={ranks[r]: lib for r, lib in old.library.items() if r in ranks})
        self.params = self.named_global_params()
        if self.main is not None:  # same fp32 main parameters (and optimizer state) over the rebuilt model
            self.main = self.main.rebind(self.params)
            self.main.copy_to_model()
        self.optimizer = self._optimizer()
        self.optimizer.load_state_dict(opt_state)  # same parameter order: state moves by position
        self.sync = self._gradient_synchronizer()
        self.executor = self._executor(actions, links, split_backward=split_backward, steps=steps)

    # ---- checkpoints ------------------------------------------------------------------------
    def _slots(self, values: Mapping[str, torch.Tensor] | None = None, writers: set | None = None):
        """Checkpoint slots of this rank's parameters: ``values`` (fp32 main values in local form from
        the distributed optimizer, of the parameters this rank writes), else the optimizer's parameters
        (fp32 main values in mixed precision). The form is the same with and without the distributed
        optimizer; ``main``: this rank writes the parameter (``writers``: ``grad_sync.checkpoint_writers``,
        computed when not given)."""
        from megatron_het.checkpoint.dist_ckpt import TensorSlot
        from megatron_het.runtime.grad_sync import checkpoint_writers

        writers = checkpoint_writers(self.sync.all_holdings) if writers is None else writers

        if self.grid_groups is not None and values is None:  # a 3D stage's blocks at their grid offsets
            values = {n: p.detach() for n, p in self.opt_params.items()}
        if self.grid_groups is not None:
            from megatron_het.checkpoint.tp_layout import grid_rank_offsets

            grid = self.stage_plan.tp_grid
            return {name: TensorSlot(tensor=t, partition_dim=self.sync.local[name].partition_dim, tp_rank=self.role.tp_rank,
                                     tp_size=self.role.tp_size, main=(name, self.role.rank) in writers,
                                     offsets=grid_rank_offsets(name, grid, self.role.tp_rank,
                                                               self.sync.local[name].partition_dim))
                    for name, t in values.items()}
        if values is None:  # loading: the slots give shapes; the distributed optimizer's are fp32
            values = ({n: torch.empty(p.shape, dtype=torch.float32, device="meta") for n, p in self.params.items()}
                      if self.plan.use_distributed_optimizer else {n: p.detach() for n, p in self.opt_params.items()})
        # each piece at its holding's TP place (a routed expert's: its expert-TP place, plan/experts.py)
        return {name: TensorSlot(tensor=t, partition_dim=self.sync.local[name].partition_dim,
                                 tp_rank=self.sync.local[name].tp_rank, tp_size=self.sync.local[name].tp_size,
                                 main=(name, self.role.rank) in writers,
                                 glu=is_glu(name, self.model_spec.swiglu))
                for name, t in values.items()}

    @phase("save")
    def save_checkpoint(self, save: str, iteration: int, *, tokenizer_model: str | None = None) -> str:
        """Write model, optimizer, iteration and data position under ``save`` (collective)."""
        from megatron_het.checkpoint.dist_ckpt import model_common_state, save_checkpoint
        from megatron_het.runtime.grad_sync import checkpoint_writers

        values = None
        writers = checkpoint_writers(self.sync.all_holdings)
        if self.plan.use_distributed_optimizer:  # shards gathered into the plain run's local form, on the host
            values, moments = self.sync.local_state(only={n for n in self.params if (n, self.role.rank) in writers})
        else:
            moments = {}
            for name, p in self.opt_params.items():
                st = self.optimizer.state.get(p, {})
                moments[name] = {k: st.get(k, torch.zeros_like(p)).detach() for k in ("exp_avg", "exp_avg_sq")}
        common = {"model": model_common_state(self.model_spec), "padded_vocab": self.stage.vocab_size,
                  "consumed_samples": self.data_position.consumed_at(iteration, self.train.global_batch_size),
                  "plan": self.plan.to_dict(), "seed": self.train.seed}
        return save_checkpoint(save, iteration, params=self._slots(values, writers), optimizer_state=moments, common=common,
                               tokenizer_model=tokenizer_model)

    @torch.no_grad()
    @phase("load")
    def load_checkpoint(self, path: str, *, with_optimizer: bool = True) -> int:
        """Load a checkpoint written under any plan; returns its iteration (collective). The stage's
        slots are read a group at a time (``dist_ckpt.load_in_groups``): host memory holds one group's
        fp32 values and moments, not the stage's."""
        from megatron_het.checkpoint.dist_ckpt import CheckpointError, load_in_groups, open_checkpoint

        path, common = open_checkpoint(path, model=self.model_spec)
        if common.get("padded_vocab") != self.stage.vocab_size:
            raise CheckpointError(
                f"{path}: padded_vocab: the checkpoint has {common.get('padded_vocab')} embedding rows, this plan "
                f"builds {self.stage.vocab_size}. Fix: construct the trainer with padded_vocab="
                f"{common.get('padded_vocab')} (pretrain_gpt.py does this when --load is given)")
        iteration = int(common["iteration"])
        self.data_position = position_from_checkpoint(common, self.train.global_batch_size)
        distributed = self.plan.use_distributed_optimizer
        opt_params = self.opt_params

        def take(values, moments):
            if distributed:  # this rank's pieces of the plan-independent form
                self.sync.load_local_state(values, moments if with_optimizer else None, step=iteration)
                return
            for name, value in values.items():
                p = opt_params[name]
                p.copy_(value)
                if with_optimizer:
                    self.optimizer.state[p] = {"step": torch.tensor(float(iteration)),  # host scalar, as torch's Adam
                                               "exp_avg": moments[name]["exp_avg"].to(p.device, copy=True),
                                               "exp_avg_sq": moments[name]["exp_avg_sq"].to(p.device, copy=True)}

        load_in_groups(path, params=self._slots(), with_optimizer=with_optimizer, take=take)
        if self.main is not None and not distributed:
            self.main.copy_to_model()
        return iteration

    def shards(self) -> dict[str, Shard]:
        if hasattr(self.sync, "finish_param_gather"):  # --overlap-param-gather: the last step's gathers
            self.sync.finish_param_gather()
        if self.grid_groups is not None:
            return local_grid_shards(self.gpt, layer_offset=self.role.layers[0], grid=self.stage_plan.tp_grid,
                                     grid_rank=self.role.tp_rank, tied=self.tied)
        out: dict[str, Shard] = {}
        for gpt, (first, _) in zip(self.gpts, self.chunk_ranges):
            out.update(local_shards(gpt, layer_offset=first, tp_rank=self.role.tp_rank, tp_size=self.role.tp_size,
                                    tied=self.tied, gated=self.model_spec.swiglu, experts=self.experts))
        return out

    def summary_lines(self, logs: Sequence[IterationLog]) -> list[str]:
        """Every rank's compute/idle, gathered; rank 0 gets one line per stage (mean over its ranks)."""
        from megatron_het.runtime.tensorboard_log import gather_stage_times

        stages = gather_stage_times(self.role, logs, group=None, dst=0, accelerator=self.accelerator)
        if stages is None:
            return []
        lines = ["per-stage time over the run (mean over the stage's ranks):"]
        for st in stages:
            n = st.iterations
            lines.append(f"  replica {st.replica} stage {st.stage} ({st.island}): compute "
                         f"{st.compute_s / n * 1000:8.1f} ms/it, idle {st.idle_s / n * 1000:8.1f} ms/it "
                         f"({100 * st.idle_s / max(st.compute_s + st.idle_s, 1e-9):4.1f}% idle), peak memory "
                         f"{st.peak_memory_bytes / 2**20:.0f} MiB")
        return lines


def HeteroTrainer(*, model: ModelSpec, plan: Plan, train: TrainConfig, batch_fn: BatchFn,  # noqa: N802
                  cluster: ClusterSpec | None = None, init_full_state: Mapping[str, torch.Tensor] | None = None,
                  padded_vocab: int | None = None, slowdown: float | None = None,
                  clock: Callable[[], float] | None = None, hooks: TrainerHooks | None = None,
                  accelerator: Accelerator | None = None) -> Trainer:
    """The trainer over this rank's stage of ``plan`` (call on every rank). ``slowdown`` overrides the
    cluster's emulation factor of the rank's island; ``clock`` is the timer's (None: wall time)."""
    with phase("construction"):
        strategy = PipelineStrategy(model=model, plan=plan, train=train, batch_fn=batch_fn, cluster=cluster,
                                    init_full_state=init_full_state, padded_vocab=padded_vocab, accelerator=accelerator)
    timer = emulation_timer(cluster, strategy.role.island, slowdown=slowdown, clock=clock,
                            accelerator=strategy.accelerator)
    if timer.slowdown != 1.0:
        logger.info("rank %d (%s): EMULATED device speed, compute slowed %.2fx", strategy.rank,
                    strategy.role.island, timer.slowdown)
    return Trainer(strategy=strategy, train=train, hooks=hooks, timer=timer)
