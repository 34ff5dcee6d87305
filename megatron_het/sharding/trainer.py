"""Sharded strategy: one GPT with uneven sharded data parallelism (compute share by speed, state by memory).

Each rank builds the whole model (megatron-core GPTModel, TP=1, PP=1, explicit process groups)
and owns a share of every parameter's fp32 optimizer state sized by ``plan.shard_fraction``: the
state is the pipeline runtime's distributed optimizer (``optim/distributed.py``; every rank is a
holder of every parameter, weights = the fractions), one implementation for both modes.
One iteration:

1. run the rank's ``num_micro_batches`` micro-batches of ``micro_batch_size`` samples (its
   consecutive slice of the global batch), gradients accumulating in a full-size buffer. Each
   micro-batch's loss is its *sum* of token losses divided by ``global_batch_size x seq_length``,
   so every sample weighs the same whatever micro-batch it is in, and the sum over ranks is the
   mean token loss of the global batch (= the single-device loss when all samples have equal
   length, as here);
2. reduce-scatter the gradients (uneven, ``comm/uneven.py``): each rank gets the summed gradient of
   its pieces;
3. global-norm clipping (squared norms summed over pieces) and AdamW on the pieces;
4. all-gather the updated pieces (uneven) into every rank's working weights.

Mixed precision as the pipeline strategy's distributed optimizer does it: ``--bf16``/``--fp16`` build the
model in half precision inside megatron-core's ``Float16Module``, gradients accumulate into fp32 main
gradients (``runtime/mixed_precision.MainGrads``), the fp32 main values exist only as each rank's
shard; with ``--fp16`` the loss is scaled and each rank unscales and checks its reduced pieces
(overflow agreed over the world, the step skipped everywhere).

Speed is emulated on CPU by the trainer's timer (``train/timer.py``): after each forward/backward
the rank sleeps ``(slowdown - 1) x`` the measured time. Memory is emulated by a per-rank byte budget.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
import torch.distributed as dist

from megatron_het.checkpoint.full_state import Shard, global_name, load_full_state
from megatron_het.cluster import ClusterSpec, ConfigError, ModelSpec
from megatron_het.model.gpt import StageModelSpec, build_gpt_stage, transformer_config
from megatron_het.optim.layout import FlatIndex, sample_ranges
from megatron_het.perf.flops import padded_vocab_size
from megatron_het.perf.sharded import sharded_rank_memory
from megatron_het.plan import ShardedPlan
from megatron_het.platform import Accelerator, detect_accelerator
from megatron_het.runtime.comm_routing import all_reduce_world
from megatron_het.runtime.group_ledger import GroupLedger
from megatron_het.runtime.initial_values import SeededFullState, load_seeded
from megatron_het.runtime.megatron_trainer import split_tokens
from megatron_het.runtime.mixed_precision import LossScaler, MainGrads, params_dtype, wrap_float16
from megatron_het.sharding.budget import check_budget
from megatron_het.sharding.checkpoint import load_sharded, save_sharded
from megatron_het.train.config import TrainConfig
from megatron_het.train.data_position import DataPosition, positioned_batches
from megatron_het.train.strategy import ActionHook, BatchFn, IterationLog, StepResult
from megatron_het.train.timer import EmulationTimer, emulation_timer
from megatron_het.train.trainer import Trainer
from megatron_het.utils.eval_mode import eval_mode

__all__ = ["ShardedStrategy", "ShardedTrainer"]

logger = logging.getLogger(__name__)


class ShardedStrategy:
    """This rank's model and state shard of a ShardedPlan. Construct on every rank."""

    def __init__(self, *, model: ModelSpec, plan: ShardedPlan, train: TrainConfig, batch_fn: BatchFn,
                 cluster: ClusterSpec | None = None,
                 init_full_state: Mapping[str, torch.Tensor] | None = None, padded_vocab: int | None = None,
                 memory_budget_bytes: Sequence[int] | None = None,
                 gather_method: Literal["padded", "broadcast"] = "padded",
                 reduce_scatter_method: Literal["native", "reduce", "all_reduce"] = "native",
                 accelerator: Accelerator | None = None) -> None:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from megatron_het.model.groups import BlockShape, block_process_groups

        if model.is_moe:  # the routers' auxiliary-loss scale and expert placement are the pipeline runtime's
            raise ConfigError("the sharded data-parallel strategy does not train mixture-of-experts models yet",
                              field="num_experts", value=model.num_experts,
                              fix="use a pipeline plan (tools/plan.py --mode pipeline), which runs MoE (docs/moe.md)")
        world, rank = dist.get_world_size(), dist.get_rank()
        if plan.world_size != world:
            raise ValueError(f"plan.ranks: the plan has {plan.world_size} ranks, the world {world}. "
                             f"Fix: launch {plan.world_size} processes or re-plan for {world}")
        if plan.global_batch_size != train.global_batch_size:
            raise ConfigError(f"the plan has {plan.global_batch_size}", field="--global-batch-size",
                              value=train.global_batch_size, fix="pass the plan's global batch size")
        if memory_budget_bytes is not None and len(memory_budget_bytes) != world:
            raise ValueError(f"memory_budget_bytes: has {len(memory_budget_bytes)} entries for {world} ranks. "
                             "Fix: pass one budget per rank")
        self.model_spec, self.plan, self.train, self.batch_fn = model, plan, train, batch_fn
        self.data_position = DataPosition()  # fresh run; load_checkpoint resumes the checkpoint's (train/data_position.py)
        self.rank, self.share = rank, plan.ranks[rank]
        self.reports_shards = rank == 0  # every rank gathers the same full tensors; one copy is enough
        self.gather_method, self.reduce_scatter_method = gather_method, reduce_scatter_method
        self.accelerator = acc = accelerator or detect_accelerator()
        self.device = acc.device
        acc.set_device()
        self.groups = GroupLedger()  # every group built below, destroyed by close()
        _, self.pgc = block_process_groups(BlockShape(tp=1, pp=1, dp=world), timeout=train.group_timeout,
                                           backend=acc.torch_backend)
        # ranks of different collective libraries (NVIDIA beside AMD): the state's collectives go
        # through the het bridge (no one torch communicator spans both)
        self.bridge = None
        if cluster is not None:
            from megatron_het.runtime.comm_routing import RankPlacement, new_bridge_group

            placement = RankPlacement(island={s.rank: s.island for s in plan.ranks},
                                      library={s.rank: cluster.island(s.island).device.collective_library
                                               for s in plan.ranks})
            if placement.spans_libraries(range(world)):
                self.bridge = new_bridge_group(range(world), placement, accelerator=acc,
                                               timeout=train.group_timeout)
        if rank == 0:
            logger.info("communication paths: state collectives (all-gather, reduce-scatter): %s",
                        "het-bridge" if self.bridge is not None else f"native ({acc.torch_backend})")

        # Same seed on every rank: identical initial weights; each keeps only its share of the state.
        torch.manual_seed(train.seed)
        model_parallel_cuda_manual_seed(train.seed, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
        self.stage = StageModelSpec(model=model, num_layers=model.num_layers, layer_offset=0, tp=1,
                                    pre_process=True, post_process=True,
                                    vocab_size=padded_vocab or padded_vocab_size(model.vocab_size, tp=1),
                                    recompute=self.share.recompute, transformer_impl=train.transformer_impl,
                                    params_dtype=params_dtype(train.precision))
        self.config = transformer_config(self.stage, cpu_initialization=not acc.is_gpu, initialize=False)
        self.gpt = build_gpt_stage(self.stage, self.config, self.pgc, device=self.device)
        # bf16: Megatron's Float16Module (bf16 weights and activations, fp32 per-token losses)
        self.module = wrap_float16(self.config, self.gpt) if train.precision != "fp32" else self.gpt
        self.tied = not model.untie_embeddings_and_output_weights
        named = [(global_name(n, 0), p) for n, p in self.gpt.named_parameters()]
        self.params = dict(named)
        if init_full_state is None:  # a fresh run: the seeded full model, as under pipeline plans
            load_seeded(self.params, self.weight_holdings()[0],
                        SeededFullState(model, seed=train.seed, padded_vocab=self.stage.vocab_size))
        else:
            load_full_state(self.gpt, init_full_state, layer_offset=0, tp_rank=0, tp_size=1, tied=self.tied)
        self.shapes = {n: tuple(p.shape) for n, p in named}
        self.index = FlatIndex(names=tuple(n for n, _ in named), numels=tuple(p.numel() for _, p in named))
        # bf16: fp32 main gradients, accumulated from autograd's hooks; the optimizer keeps the fp32
        # main values as shards (no full fp32 copy), as the pipeline's distributed optimizer
        self.main = MainGrads(self.params) if train.precision != "fp32" else None
        # fp16: megatron-core's grad scaler; the reduced fp32 pieces are unscaled and checked (all ranks agree)
        self.scaler = LossScaler(train, self.device) if train.fp16 else None
        # The state is sharded by the pipeline runtime's distributed optimizer (one implementation,
        # optim/distributed.py): every rank holds every parameter (TP=1), so one group over the world
        # splits each parameter in proportion to the plan's shard fractions.
        self.optimizer = self._distributed_optimizer(world, rank)
        self.groups.seal()
        self.samples = sample_ranges(plan.samples_per_rank)[rank]
        self.memory = sharded_rank_memory(model, shard_fraction=plan.shard_fractions[rank],
                                          micro_batch_size=self.share.micro_batch_size,
                                          recompute=self.share.recompute,
                                          precision=train.precision, overhead_bytes=0,
                                          num_parameters=self.index.numel)
        if memory_budget_bytes is not None:
            check_budget(self.memory, rank=rank, budget_bytes=int(memory_budget_bytes[rank]),
                         shard_fraction=plan.shard_fractions[rank])

    def close(self) -> None:
        """Destroy the process groups this strategy created (as the pipeline strategy does); the strategy
        cannot step afterwards. Every rank calls it, like the constructor."""
        self.groups.destroy()

    def _distributed_optimizer(self, world: int, rank: int):
        """The sharded state: ``optim.DistributedOptimizer`` over holders that all hold every full parameter."""
        from megatron_het.optim.distributed import DistributedOptimizer
        from megatron_het.runtime.comm_routing import BridgedGroup, NativeGroup
        from megatron_het.runtime.grad_sync import Holding, owned_norm_holdings

        local = [Holding(name=n, rank=rank, stage_key=(rank, 0), tp_rank=0, tp_size=1, partition_dim=None,
                         full_shape=tuple(p.shape)) for n, p in self.params.items()]
        group = BridgedGroup(self.bridge) if self.bridge is not None else NativeGroup(None)  # the whole world
        return DistributedOptimizer(local, self.params, train=self.train, device=self.device,
                                    owned=owned_norm_holdings, new_group=lambda ranks: group,
                                    main_grads=self.main.grads if self.main is not None else None,
                                    weights={r: float(f) for r, f in enumerate(self.plan.shard_fractions)},
                                    gather_method=self.gather_method, reduce_scatter_method=self.reduce_scatter_method)

    # ---- one iteration -----------------------------------------------------------------------
    def step(self, iteration: int, *, lr: float, timer: EmulationTimer, on_action: ActionHook | None) -> StepResult:
        it, share, train = iteration, self.share, self.train
        comm = 0.0
        if self.main is not None:
            self.main.zero_grad()
        else:
            for p in self.params.values():
                p.grad = None
        scale = 1.0 / (train.global_batch_size * self.model_spec.seq_length)
        loss_scale = self.scaler.scale.clone() if self.scaler is not None else None  # read at the log interval
        loss_sum = torch.zeros(1, dtype=torch.float64, device=self.device)  # on the device: no sync per micro-batch
        batch_fn = positioned_batches(self.batch_fn, self.data_position, train.global_batch_size)
        for m in range(share.num_micro_batches):
            first = self.samples.start + m * share.micro_batch_size
            tokens = batch_fn(it, range(first, first + share.micro_batch_size))
            inputs, labels, position_ids, _ = split_tokens(tokens, self.device)
            loss = timer.compute(lambda: self.module(inputs, position_ids, None, labels=labels).float().sum() * scale)
            scaled = loss * loss_scale if loss_scale is not None else loss  # fp16: the scaled loss's backward
            timer.compute(lambda: scaled.backward())
            loss_sum += loss.detach().double()
        t0 = time.perf_counter()
        opt = self.optimizer
        opt.reduce()  # uneven reduce-scatter: this rank's pieces of the summed gradient
        skipped = self.scaler.unscale_and_check([opt.shard_grad]) if self.scaler is not None else False
        # squared norm and loss sum in one world all-reduce, kept on the device (read at the log interval)
        both = all_reduce_world(torch.cat([opt.grad_norm_sq_local().reshape(1).double(), loss_sum]))
        norm = both[0].sqrt()
        comm += time.perf_counter() - t0
        if train.clip_grad > 0 and not skipped:  # megatron's clip_grad_by_total_norm_fp32, coefficient on the device
            opt.scale_grads((train.clip_grad / (norm + 1e-6)).clamp(max=1.0))  # (x 1.0 is exact)
        t0 = time.perf_counter()
        opt.param_groups[0]["lr"] = lr
        if not skipped:
            opt.step()  # AdamW on the pieces, then the uneven all-gather into the working weights
        opt_s = time.perf_counter() - t0
        return StepResult(lm_loss=both[1], grad_norm=norm if not skipped else math.nan, comm_s=comm,
                          optimizer_s=opt_s, skipped=skipped, loss_scale=loss_scale)

    @torch.no_grad()
    def evaluate(self, batch_fn: BatchFn, iteration: int) -> float:
        """Forward-only mean token loss of one global batch from ``batch_fn`` (collective).

        The working weights hold the last step's gathered values; each rank evaluates its own samples,
        as in training.
        """
        scale = 1.0 / (self.train.global_batch_size * self.model_spec.seq_length)
        loss_sum, mbs = torch.zeros(1, dtype=torch.float64, device=self.device), self.share.micro_batch_size
        with eval_mode([self.module]):  # dropout off, as Megatron-LM's evaluate()
            for m in range(self.share.num_micro_batches):
                first = self.samples.start + m * mbs
                inputs, labels, position_ids, _ = split_tokens(batch_fn(iteration, range(first, first + mbs)),
                                                               self.device)
                loss_sum += self.module(inputs, position_ids, None, labels=labels).double().sum() * scale
        all_reduce_world(loss_sum)
        return float(loss_sum)

    # ---- checkpoints (sharding/checkpoint.py; the pipeline runtime's format) -------------------
    def save_checkpoint(self, save: str, iteration: int, *, tokenizer_model: str | None = None) -> str:
        """Write the full state under ``save`` (collective); returns the iteration directory."""
        return save_sharded(self, save, iteration, tokenizer_model=tokenizer_model)

    def load_checkpoint(self, path: str, *, with_optimizer: bool = True) -> int:
        """Load an iteration directory written under any plan (collective); returns its iteration."""
        return load_sharded(self, path, with_optimizer=with_optimizer)

    # ---- state as global-named full tensors ---------------------------------------------------
    def shards(self) -> dict[str, Shard]:
        """Current weights as full global-named tensors (every rank holds them whole)."""
        return {n: Shard(tensor=p.detach().clone(), partition_dim=None, tp_rank=0, tp_size=1)
                for n, p in self.params.items()}

    def weight_holdings(self):
        """Every rank holds every parameter whole (TP = 1): one holding per parameter, its own stage."""
        from megatron_het.runtime.holdings import stage_holdings

        return stage_holdings(self.params, rank=self.rank, stage_key=(self.rank, 0), tp_rank=0, tp_size=1,
                              gated=False), self.params

    def check_weights(self, context: str) -> int:
        from megatron_het.runtime.consistency import check_holders_agree

        return check_holders_agree(self.weight_holdings()[0], self.params, context=context)

    def summary_lines(self, logs: Sequence[IterationLog]) -> list[str]:
        """Every rank's time split, gathered; one line per rank (ms per iteration) on rank 0."""
        n = len(logs)
        mine = (self.rank, self.share.island, sum(l.compute_s for l in logs), sum(l.emulated_s for l in logs),
                sum(l.comm_s for l in logs), sum(l.optimizer_s for l in logs), self.share.samples)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if self.rank != 0:
            return []
        lines = ["per-rank time over the run (comm includes waiting for slower ranks):"]
        for rank, island, compute, emulated, comm, opt, samples in gathered:
            lines.append(f"  rank {rank} ({island}, {samples} samples/it): compute {compute / n * 1000:8.1f} ms/it "
                         f"(emulated {emulated / n * 1000:.1f}), collectives {comm / n * 1000:8.1f} ms/it, "
                         f"optimizer {opt / n * 1000:6.1f} ms/it")
        return lines


def ShardedTrainer(*, model: ModelSpec, plan: ShardedPlan, train: TrainConfig, batch_fn: BatchFn,  # noqa: N802
                   cluster: ClusterSpec | None = None, init_full_state: Mapping[str, torch.Tensor] | None = None,
                   padded_vocab: int | None = None, slowdown: float | None = None,
                   clock: Callable[[], float] | None = None, memory_budget_bytes: Sequence[int] | None = None,
                   gather_method: Literal["padded", "broadcast"] = "padded",
                   reduce_scatter_method: Literal["native", "reduce", "all_reduce"] = "native",
                   accelerator: Accelerator | None = None) -> Trainer:
    """The trainer over this rank's shard of ``plan`` (call on every rank); ``slowdown`` overrides the
    cluster's emulation factor of the rank's island."""
    strategy = ShardedStrategy(model=model, plan=plan, train=train, batch_fn=batch_fn, cluster=cluster,
                               init_full_state=init_full_state, padded_vocab=padded_vocab,
                               memory_budget_bytes=memory_budget_bytes, gather_method=gather_method,
                               reduce_scatter_method=reduce_scatter_method, accelerator=accelerator)
    timer = emulation_timer(cluster, strategy.share.island, slowdown=slowdown, clock=clock,
                            accelerator=strategy.accelerator)
    return Trainer(strategy=strategy, train=train, timer=timer)
