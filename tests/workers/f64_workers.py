"""A float64 "truth" for the fp32 parity tests' final parameters (issues #16 and #20).

The single-process reference's training (megatron-core GPTModel, the same initial full state,
batches, per-micro-batch token means averaged over the micro-batches, global-norm clipping and
AdamW with Megatron's no-weight-decay groups) replayed in float64 in this process, so that both the
fp32 reference and a runtime can be measured against something an order of magnitude more accurate
than either (tests/support/param_diff.py compares them).

What differs from the reference on purpose: megatron-core's ``vocab_parallel_cross_entropy`` casts
the logits to fp32, so the model is called without labels and the cross-entropy is torch's on the
float64 logits (with one process, the vocabulary-parallel loss is exactly this one); megatron-core's
DDP and optimizer wrappers (fp32 grad buffers and norms) are replaced by autograd's float64 ``.grad``,
the same clip formula and ``torch.optim.AdamW`` (what ``get_megatron_optimizer`` builds without
Apex/TE) in float64.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatron_het.cluster import ModelSpec
from megatron_het.train.config import TrainConfig
from megatron_het.train.lr_schedule import lr_at

from workers.megatron_workers import batch_fn, megatron_block_worker


@dataclass(frozen=True, kw_only=True)
class Fault:
    """A deliberate bug injected into the float64 replay, to show a parity criterion can fail."""

    drop_micro_batch: tuple[int, int] | None = None  # (0-based iteration, micro-batch) whose gradient is left out
    lr_scale: tuple[str, float] | None = None  # (full-state name, factor) applied to that tensor's learning rate


@dataclass(frozen=True, kw_only=True)
class TruthRun:
    """The float64 replay's outcome."""

    losses: tuple[float, ...]  # per iteration: the mean of the micro-batches' token-mean losses
    final: dict[str, torch.Tensor]  # final full state (float64), named as checkpoint/full_state.py
    dtypes: frozenset  # dtypes of every module output seen in the first forward (float64 only: no hidden cast)


def float64_truth(*, model: ModelSpec, train: TrainConfig, init_full_state: Mapping[str, torch.Tensor],
                  padded_vocab: int, micro_batch_size: int | None = None, fault: Fault | None = None) -> TruthRun:
    """Replay the single-process reference's ``train.train_iters`` steps in float64 (call inside a
    gloo process: megatron-core's model takes explicit process groups). ``micro_batch_size`` regroups
    the same samples (None: the train config's)."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_het.checkpoint.full_state import assemble_full_state, load_full_state, local_shards
    from megatron_het.model.gpt import StageModelSpec, build_gpt_stage, transformer_config
    from megatron_het.model.groups import BlockShape, block_process_groups
    from megatron_het.runtime.megatron_trainer import split_tokens

    fault = fault or Fault()
    mbs = micro_batch_size or train.micro_batch_size
    if train.global_batch_size % mbs:
        raise ValueError(f"micro_batch_size {mbs} does not divide global_batch_size {train.global_batch_size}. "
                         f"Fix: pass a divisor")
    _, pgc = block_process_groups(BlockShape(tp=1, pp=1, dp=1))
    torch.manual_seed(train.seed)
    model_parallel_cuda_manual_seed(train.seed, tp_rank=0, ep_rank=0, etp_rank=0)
    stage = StageModelSpec(model=model, num_layers=model.num_layers, layer_offset=0, tp=1, pre_process=True,
                           post_process=True, vocab_size=padded_vocab, params_dtype=torch.float64)
    gpt = build_gpt_stage(stage, transformer_config(stage), pgc).double()
    tied, gated = not model.untie_embeddings_and_output_weights, model.swiglu
    load_full_state(gpt, {k: v.double() for k, v in init_full_state.items()}, layer_offset=0, tp_rank=0, tp_size=1,
                    tied=tied, gated=gated)

    named = [(n, p) for n, p in gpt.named_parameters() if p.requires_grad]
    # Megatron's groups: no weight decay on biases and 1-D parameters; a fault's tensor in its own group
    groups = []
    for wd_mult in (1.0, 0.0):
        for scaled in (False, True):
            params = [p for n, p in named if (0.0 if n.endswith(".bias") or p.dim() == 1 else 1.0) == wd_mult
                      and (fault.lr_scale is not None and n == fault.lr_scale[0]) == scaled]
            if params:
                groups.append({"params": params, "wd_mult": wd_mult,
                               "lr_mult": fault.lr_scale[1] if scaled else 1.0})
    if fault.lr_scale is not None and not any(g["lr_mult"] != 1.0 for g in groups):
        raise ValueError(f"fault.lr_scale names {fault.lr_scale[0]!r}, not a parameter. Fix: use a local name")
    opt = torch.optim.AdamW(groups, lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
                            weight_decay=train.weight_decay)

    dtypes: set = set()
    hooks = [m.register_forward_hook(lambda _m, _i, out: dtypes.update(
        t.dtype for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)
        and t.is_floating_point())) for m in gpt.modules()]
    batches = batch_fn(model, train.seed)
    losses = []
    for it in range(train.train_iters):
        tokens = batches(it, range(train.global_batch_size))
        micro = [tokens[i:i + mbs] for i in range(0, train.global_batch_size, mbs)]
        for p in gpt.parameters():
            p.grad = None
        total = torch.zeros((), dtype=torch.float64)
        for j, mb in enumerate(micro):
            inputs, labels, position_ids, loss_mask = split_tokens(mb)
            logits = gpt(inputs, position_ids, None)  # [b, s, padded vocab] without labels
            per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
            mask = loss_mask.reshape(-1).double()
            loss = (per_token * mask).sum() / mask.sum() / len(micro)  # megatron: /num_tokens, /num_microbatches
            if fault.drop_micro_batch != (it, j):
                loss.backward()
            total += loss.detach()
            for h in hooks:
                h.remove()
            hooks = []
        grads = [p.grad for _, p in named if p.grad is not None]
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        coeff = train.clip_grad / (norm + 1.0e-6)  # megatron.core.optimizer.clip_grads
        if train.clip_grad > 0 and coeff < 1.0:
            for g in grads:
                g.mul_(coeff)
        lr = lr_at(train, it)
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_mult"]
            g["weight_decay"] = train.weight_decay * g["wd_mult"]
        opt.step()
        losses.append(float(total))
    shards = local_shards(gpt, layer_offset=0, tp_rank=0, tp_size=1, tied=tied, gated=gated)
    return TruthRun(losses=tuple(losses), final=assemble_full_state([shards]), dtypes=frozenset(dtypes))


def reference_and_truth_worker(rank, world_size, model: ModelSpec, train: TrainConfig, padded_vocab: int,
                               truths: Mapping[str, dict] | None = None,
                               more_references: Mapping[str, TrainConfig] | None = None):
    """The fp32 single-process megatron-core reference, then float64 replays of it from its initial
    state in the same process (one spawn, one megatron import). ``truths``: name -> keyword
    arguments of ``float64_truth`` (micro_batch_size, fault); default one plain replay "truth".
    ``more_references``: name -> another TrainConfig for an fp32 reference from the same initial state
    (e.g. other micro-batches). Returns (reference RunResult, {name: TruthRun | RunResult})."""
    from megatron_het.checkpoint.full_state import assemble_full_state
    from megatron_het.model.groups import BlockShape
    from megatron_het.runtime.megatron_trainer import train_megatron_block

    ref = megatron_block_worker(rank, world_size, model, train, BlockShape(tp=1, pp=1, dp=1), None, padded_vocab)
    init = assemble_full_state([ref.initial_shards])
    out = {name: float64_truth(model=model, train=train, init_full_state=init, padded_vocab=padded_vocab, **kw)
           for name, kw in (truths or {"truth": {}}).items()}
    for name, other in (more_references or {}).items():
        out[name] = train_megatron_block(model=model, train=other, shape=BlockShape(tp=1, pp=1, dp=1),
                                         batch_fn=batch_fn(model, other.seed), init_full_state=init,
                                         return_shards=True, padded_vocab=padded_vocab)
    return ref, out


def lr_fault_hetero_worker(rank, world_size, model: ModelSpec, cases, train: TrainConfig, init_full_state,
                           padded_vocab: int):
    """The runtime with a deliberate bug: ``cases`` [(name, plan, (global name, factor) | None)], each
    run in turn; the named tensor's every AdamW update scaled by ``factor`` on the ranks holding it (the
    update is linear in lr, weight decay included: exactly that tensor's learning rate x factor).
    Returns {name: this rank's final shards, or None}."""
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    enable_cpu_backend()
    out = {}
    for name, plan, lr_scale in cases:
        trainer = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed),
                                init_full_state=init_full_state, padded_vocab=padded_vocab)
        target = trainer.strategy.opt_params.get(lr_scale[0]) if lr_scale else None
        if target is not None:
            trainer.strategy.optimizer.step = _scaled_step(trainer.strategy.optimizer.step, target, lr_scale[1])
        out[name] = trainer.run(return_shards=True).shards
    return out


def _scaled_step(step, param: torch.Tensor, factor: float):
    def scaled(*args, **kwargs):
        before = param.detach().clone()
        result = step(*args, **kwargs)
        with torch.no_grad():
            param.add_((factor - 1.0) * (param - before))
        return result

    return scaled
