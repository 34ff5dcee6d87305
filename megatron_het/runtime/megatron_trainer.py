"""Plain megatron-core strategy: a homogeneous TP x PP x DP block, groups passed explicitly.

This is megatron-core's own path (DDP, ``get_megatron_optimizer``, ``get_forward_backward_func``
1F1B, ``finalize_model_grads``) with nothing of ours in the step: it is the baseline that the
heterogeneous runtime is compared against (parity tests, ``bench/runtime_overhead.py``) and the
reference single-process run (TP=PP=DP=1). It runs in the one trainer like every strategy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_het.checkpoint.full_state import Shard, load_full_state, local_shards
from megatron_het.cluster import ModelSpec
from megatron_het.model.gpt import StageModelSpec, build_gpt_stage, transformer_config
from megatron_het.model.groups import BlockShape, block_process_groups
from megatron_het.perf.flops import padded_vocab_size
from megatron_het.runtime.holdings import global_params, stage_holdings
from megatron_het.runtime.initial_values import SeededFullState, load_seeded
from megatron_het.runtime.mixed_precision import params_dtype, wrap_float16
from megatron_het.train.config import TrainConfig
from megatron_het.train.lr_schedule import lr_at
from megatron_het.train.strategy import ActionHook, BatchFn, IterationLog, RunResult, StepResult
from megatron_het.train.timer import EmulationTimer
from megatron_het.train.trainer import Trainer


def lm_loss_func(loss_mask: torch.Tensor):
    """Megatron-LM's loss_func: (sum of token losses, token count, reporting tensor)."""

    def loss_func(output_tensor: torch.Tensor):
        losses = output_tensor.float().view(-1)
        mask = loss_mask.view(-1).float()
        loss_sum = torch.sum(losses * mask)
        num_tokens = mask.sum().to(torch.int)
        report = torch.stack([loss_sum.detach().clone(), num_tokens.detach().float()])
        return loss_sum, num_tokens, {"lm loss": report}

    return loss_func


def split_tokens(tokens: torch.Tensor, device: torch.device | None = None):
    """[b, s+1] tokens -> (inputs, labels, position_ids, loss_mask), each [b, s], on ``device`` (the
    accelerator's; None: where ``tokens`` are)."""
    if device is not None:
        tokens = tokens.to(device, non_blocking=True)
    inputs = tokens[:, :-1].contiguous()
    labels = tokens[:, 1:].contiguous()
    position_ids = torch.arange(inputs.shape[1], device=device if device is not None else tokens.device)
    position_ids = position_ids.unsqueeze(0).expand_as(inputs).contiguous()
    return inputs, labels, position_ids, torch.ones_like(labels, dtype=torch.float)


class MegatronStrategy:
    """This process's place in a homogeneous block, trained by megatron-core's own schedule and optimizer
    (a reference: it trains and reports shards; no evaluation or checkpoints)."""

    def __init__(self, *, model: ModelSpec, train: TrainConfig, shape: BlockShape, batch_fn: BatchFn,
                 init_full_state: Mapping[str, torch.Tensor] | None = None, padded_vocab: int | None = None) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        if model.is_moe and (shape.tp > 1 or shape.pp > 1):
            # an MoE stage is an explicit block of its layers (model/gpt.layer_spec) that megatron-core's
            # pipeline does not slice, and MoE under TP needs sequence parallelism, which this block lacks
            raise ValueError(f"the megatron-core reference block runs MoE models at TP = PP = 1 (got TP {shape.tp}, "
                             f"PP {shape.pp}). Fix: use BlockShape(tp=1, pp=1, dp=...), or the pipeline runtime")
        self.model_spec, self.train, self.shape, self.batch_fn = model, train, shape, batch_fn
        self.rank = dist.get_rank()
        _, pgc = block_process_groups(shape, timeout=train.group_timeout)
        self.pgc = pgc
        self.tp_rank, pp_rank, self.dp_rank = pgc.tp.rank(), pgc.pp.rank(), pgc.dp.rank()
        self.reports_shards = self.dp_rank == 0  # replicas hold equal copies: one is enough
        torch.manual_seed(train.seed)
        model_parallel_cuda_manual_seed(train.seed, tp_rank=self.tp_rank, ep_rank=0, etp_rank=0)

        self.stage = StageModelSpec(model=model, num_layers=model.num_layers, layer_offset=0, tp=shape.tp,
                                    pre_process=pp_rank == 0, post_process=pp_rank == shape.pp - 1,
                                    vocab_size=padded_vocab or padded_vocab_size(model.vocab_size, tp=shape.tp),
                                    params_dtype=params_dtype(train.precision))
        config = transformer_config(self.stage, pp=shape.pp, initialize=False)
        self.gpt = build_gpt_stage(self.stage, config, pgc)
        self.layer_offset = self.gpt.decoder.layers[0].layer_number - 1 if len(self.gpt.decoder.layers) else 0
        self.tied = not model.untie_embeddings_and_output_weights
        if init_full_state is None:  # a fresh run: the seeded full model, as every strategy (initial_values.py)
            params = global_params([(self.gpt, self.layer_offset)], tied=self.tied)
            load_seeded(params, stage_holdings(params, rank=self.rank, stage_key=(self.dp_rank, pp_rank),
                                               tp_rank=self.tp_rank, tp_size=shape.tp, gated=model.swiglu),
                        SeededFullState(model, seed=train.seed, padded_vocab=self.stage.vocab_size))
        else:
            load_full_state(self.gpt, init_full_state, layer_offset=self.layer_offset, tp_rank=self.tp_rank,
                            tp_size=shape.tp, tied=self.tied, gated=model.swiglu)
        # Megatron-LM's --bf16/--fp16: Float16Module, fp32 gradient buffers, Float16OptimizerWithFloat16Params
        module = wrap_float16(config, self.gpt) if train.precision != "fp32" else self.gpt
        self.ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                           module, pg_collection=pgc)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=train.lr, min_lr=train.min_lr, weight_decay=train.weight_decay,
                            adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2, adam_eps=train.adam_eps,
                            clip_grad=train.clip_grad, params_dtype=params_dtype(train.precision),
                            bf16=train.bf16, fp16=train.fp16, loss_scale=train.loss_scale,
                            initial_loss_scale=train.initial_loss_scale, min_loss_scale=train.min_loss_scale,
                            loss_scale_window=train.loss_scale_window, hysteresis=train.hysteresis,
                            decoupled_lr=train.decoupled_lr, decoupled_min_lr=train.decoupled_min_lr),
            [self.ddp], pg_collection=pgc, use_gloo_process_groups=False)
        config.finalize_model_grads_func = (
            lambda models, num_tokens=None, **_: finalize_model_grads(models, num_tokens, pg_collection=pgc))
        self.forward_backward = get_forward_backward_func(pp_size=shape.pp, vp_size=None)
        self.p2p = P2PCommunicator(pp_group=pgc.pp, config=config)

    def step(self, iteration: int, *, lr: float, timer: EmulationTimer, on_action: ActionHook | None) -> StepResult:
        train, shape = self.train, self.shape
        per_replica = train.global_batch_size // shape.dp
        first = self.dp_rank * per_replica
        tokens = self.batch_fn(iteration, range(first, first + per_replica))
        micro = iter([tokens[i:i + train.micro_batch_size] for i in range(0, per_replica, train.micro_batch_size)])

        def forward_step(data_iterator, model_chunk):
            inputs, labels, position_ids, loss_mask = split_tokens(next(data_iterator))
            output = model_chunk(inputs, position_ids, None, labels=labels)
            return output, lm_loss_func(loss_mask)

        for group in self.optimizer.param_groups:
            # What megatron's OptimizerParamScheduler.step does: the multipliers carry
            # Megatron-LM's "no weight decay on biases and 1-D parameters" groups, and a group's
            # max_lr/min_lr megatron-core's --decoupled-lr override.
            rate = lr_at(train, iteration, group=group) if "max_lr" in group else lr
            group["lr"] = rate * group.get("lr_mult", 1.0)
            group["weight_decay"] = train.weight_decay * group.get("wd_mult", 1.0)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self.forward_backward(forward_step_func=forward_step, data_iterator=micro, model=[self.ddp],
                                        num_microbatches=per_replica // train.micro_batch_size,
                                        seq_length=self.model_spec.seq_length, micro_batch_size=train.micro_batch_size,
                                        forward_only=False, p2p_communicator=self.p2p, pg_collection=self.pgc)
        updated, grad_norm, _ = self.optimizer.step()
        loss = None
        if self.stage.post_process:
            # Megatron averages per-micro-batch means; report the same over all replicas.
            per_micro = torch.stack([r["lm loss"][0] / r["lm loss"][1] for r in reports])
            mean = per_micro.mean().reshape(1)
            dist.all_reduce(mean, group=self.pgc.dp)
            loss = float(mean) / shape.dp
        scaler = getattr(self.optimizer, "grad_scaler", None)
        return StepResult(lm_loss=loss, grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                          skipped=not updated, loss_scale=float(scaler.scale) if scaler is not None else None)

    def shards(self) -> dict[str, Shard]:
        return local_shards(self.gpt, layer_offset=self.layer_offset, tp_rank=self.tp_rank, tp_size=self.shape.tp,
                            tied=self.tied, gated=self.model_spec.swiglu)

    def summary_lines(self, logs: Sequence[IterationLog]) -> list[str]:
        return []


def train_megatron_block(*, model: ModelSpec, train: TrainConfig, shape: BlockShape, batch_fn: BatchFn,
                         init_full_state: Mapping[str, torch.Tensor] | None = None,
                         return_shards: bool = False, padded_vocab: int | None = None) -> RunResult:
    """Train ``train.train_iters`` steps on this process's place in ``shape``; call on every rank.

    ``padded_vocab`` overrides Megatron's padding (a multiple of 128 * TP): plans compared with
    each other must use the same padded vocabulary, since padded logits enter the softmax.
    """
    strategy = MegatronStrategy(model=model, train=train, shape=shape, batch_fn=batch_fn,
                                init_full_state=init_full_state, padded_vocab=padded_vocab)
    return Trainer(strategy=strategy, train=train).run(return_shards=return_shards)
