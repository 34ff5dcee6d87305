"""Plain megatron-core training of a homogeneous TP x PP x DP block, groups passed explicitly.

This is megatron-core's own path (DDP, ``get_megatron_optimizer``, ``get_forward_backward_func``
1F1B, ``finalize_model_grads``) with nothing of ours in the step: it is the baseline that the
heterogeneous runtime is compared against (parity tests, ``bench/runtime_overhead.py``) and the
reference single-process run (TP=PP=DP=1).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_het.checkpoint.full_state import Shard, load_full_state, local_shards
from megatron_het.cluster import ModelSpec
from megatron_het.runtime.gpt_model import StageModelSpec, build_gpt_stage, padded_vocab_size, transformer_config
from megatron_het.runtime.groups import BlockShape, block_process_groups
from megatron_het.runtime.train_config import TrainConfig

# batch_fn(iteration, sample_indices) -> LongTensor [len(indices), seq_length + 1]
BatchFn = Callable[[int, range], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class IterationLog:
    """What one rank saw of one iteration."""

    iteration: int  # 1-based, as Megatron logs it
    lm_loss: float | None  # mean token loss over the global batch (last-stage ranks only)
    grad_norm: float  # global gradient norm before clipping
    elapsed_s: float  # wall time of the step on this rank


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """A rank's outcome of a training run."""

    rank: int
    iterations: tuple[IterationLog, ...]
    initial_shards: Mapping[str, Shard] | None  # parameters before the first step, if requested
    shards: Mapping[str, Shard] | None  # final parameters as global-named shards, if requested
    routes: tuple = ()  # (ranks, "native" | "het-bridge") of this rank's gradient groups


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


def split_tokens(tokens: torch.Tensor):
    """[b, s+1] tokens -> (inputs, labels, position_ids, loss_mask), each [b, s]."""
    inputs = tokens[:, :-1].contiguous()
    labels = tokens[:, 1:].contiguous()
    position_ids = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs).contiguous()
    return inputs, labels, position_ids, torch.ones_like(labels, dtype=torch.float)


def train_megatron_block(*, model: ModelSpec, train: TrainConfig, shape: BlockShape, batch_fn: BatchFn,
                         init_full_state: Mapping[str, torch.Tensor] | None = None,
                         return_shards: bool = False, padded_vocab: int | None = None) -> RunResult:
    """Train on this process's place in ``shape``; call on every rank of the world.

    ``padded_vocab`` overrides Megatron's padding (a multiple of 128 * TP): plans compared with
    each other must use the same padded vocabulary, since padded logits enter the softmax.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    rank = dist.get_rank()
    _, pgc = block_process_groups(shape)
    tp_rank, pp_rank, dp_rank = pgc.tp.rank(), pgc.pp.rank(), pgc.dp.rank()
    torch.manual_seed(train.seed)
    model_parallel_cuda_manual_seed(train.seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)

    stage = StageModelSpec(model=model, num_layers=model.num_layers, layer_offset=0, tp=shape.tp,
                           pre_process=pp_rank == 0, post_process=pp_rank == shape.pp - 1,
                           vocab_size=padded_vocab or padded_vocab_size(model.vocab_size, shape.tp))
    config = transformer_config(stage, pp=shape.pp)
    gpt = build_gpt_stage(stage, config, pgc)
    layer_offset = gpt.decoder.layers[0].layer_number - 1 if len(gpt.decoder.layers) else 0
    tied = not model.untie_embeddings_and_output_weights
    if init_full_state is not None:
        load_full_state(gpt, init_full_state, layer_offset=layer_offset, tp_rank=tp_rank,
                        tp_size=shape.tp, tied=tied, gated=model.swiglu)
    keep = return_shards and dp_rank == 0
    initial = (local_shards(gpt, layer_offset=layer_offset, tp_rank=tp_rank, tp_size=shape.tp, tied=tied,
                              gated=model.swiglu) if keep else None)

    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  gpt, pg_collection=pgc)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=train.lr, min_lr=train.min_lr, weight_decay=train.weight_decay,
                        adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2, adam_eps=train.adam_eps,
                        clip_grad=train.clip_grad, params_dtype=torch.float32),
        [ddp], pg_collection=pgc, use_gloo_process_groups=False)
    config.finalize_model_grads_func = (
        lambda models, num_tokens=None, **_: finalize_model_grads(models, num_tokens, pg_collection=pgc))
    forward_backward = get_forward_backward_func(pp_size=shape.pp, vp_size=None)
    p2p = P2PCommunicator(pp_group=pgc.pp, config=config)

    per_replica = train.global_batch_size // shape.dp
    num_micro = per_replica // train.micro_batch_size
    logs = []
    for it in range(train.train_iters):
        start = time.perf_counter()
        first = dp_rank * per_replica
        tokens = batch_fn(it, range(first, first + per_replica))
        micro = iter([tokens[i:i + train.micro_batch_size]
                      for i in range(0, per_replica, train.micro_batch_size)])

        def forward_step(data_iterator, model_chunk):
            inputs, labels, position_ids, loss_mask = split_tokens(next(data_iterator))
            output = model_chunk(inputs, position_ids, None, labels=labels)
            return output, lm_loss_func(loss_mask)

        for group in optimizer.param_groups:
            # What megatron's OptimizerParamScheduler.step does: the multipliers carry
            # Megatron-LM's "no weight decay on biases and 1-D parameters" groups.
            group["lr"] = train.lr_at(it) * group.get("lr_mult", 1.0)
            group["weight_decay"] = train.weight_decay * group.get("wd_mult", 1.0)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reports = forward_backward(forward_step_func=forward_step, data_iterator=micro, model=[ddp],
                                   num_microbatches=num_micro, seq_length=model.seq_length,
                                   micro_batch_size=train.micro_batch_size, forward_only=False,
                                   p2p_communicator=p2p, pg_collection=pgc)
        _, grad_norm, _ = optimizer.step()
        loss = None
        if stage.post_process:
            # Megatron averages per-micro-batch means; report the same over all replicas.
            per_micro = torch.stack([r["lm loss"][0] / r["lm loss"][1] for r in reports])
            mean = per_micro.mean().reshape(1)
            dist.all_reduce(mean, group=pgc.dp)
            loss = float(mean) / shape.dp
        logs.append(IterationLog(iteration=it + 1, lm_loss=loss, grad_norm=float(grad_norm),
                                 elapsed_s=time.perf_counter() - start))
    shards = (local_shards(gpt, layer_offset=layer_offset, tp_rank=tp_rank, tp_size=shape.tp, tied=tied,
                             gated=model.swiglu) if keep else None)
    return RunResult(rank=rank, iterations=tuple(logs), initial_shards=initial, shards=shards)
