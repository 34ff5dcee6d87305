"""Switch a megatron-core stage's tensor-parallel linear layers to the overlapped path.

``runtime/hetero_trainer.HeteroTrainer`` builds a stage with ``runtime/gpt_model.build_gpt_stage``
(megatron-core's local spec, sequence-parallel variant) and, when the plan's
``StagePlan.tp_comm_overlap`` is set, calls, once, before the first forward (and before any DDP
wrapping, for other trainers)::

    report = apply_tp_comm_overlap(stage_model, chunks=train.tp_comm_overlap_chunks)
    logger.info(report.describe())

What is replaced (per instance; the classes are untouched, so other stages are unaffected):

* ``ColumnParallelLinear`` with ``sequence_parallel``: its ``_forward_impl`` (the hook megatron-core
  itself uses to choose the frozen-weight path) becomes ``all_gather_linear`` + bias. Everything
  else of its ``forward`` (weight passed in for tied output layers, ``gather_output``) is kept.
* ``RowParallelLinear`` with ``sequence_parallel``: its ``forward`` becomes
  ``linear_reduce_scatter`` + bias, same return value ``(output, output_bias)`` as upstream.

Layers that cannot take the path are left as they are and listed in the report with the reason:
no sequence parallelism (TP=1, or ``sequence_parallel=False``), expert layers with explicit
communication, ``gradient_accumulation_fusion`` (needs ``main_grad`` fusion we do not do) and
deferred embedding weight gradients. transformer-engine layers (GPU spec) are not megatron-core's
classes and are never touched: on GPUs use TE's own ``tp_comm_overlap`` userbuffers instead.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch

from megatron_het.comm.overlap import all_gather_linear, linear_reduce_scatter
from megatron_het.comm.overlap_chunks import OverlapConfig

__all__ = ["OverlapReport", "apply_tp_comm_overlap", "overlap_refusal"]


@dataclass(frozen=True, kw_only=True)
class OverlapReport:
    """Which layers of a stage now overlap, and why the others do not."""

    chunks: int  # requested pieces per GEMM (a shard whose rows it does not divide uses fewer)
    overlapped: tuple[str, ...]  # module names switched to the overlapped path
    skipped: tuple[tuple[str, str], ...]  # (module name, reason) left on megatron-core's path

    def describe(self) -> str:
        return (f"tp_comm_overlap: {len(self.overlapped)} layers overlapped with chunks={self.chunks}, "
                f"{len(self.skipped)} left as is"
                + "".join(f"\n  {name}: {why}" for name, why in self.skipped))


def overlap_refusal(module: Any) -> str | None:
    """Why ``module`` (a megatron-core TP linear layer) cannot take the overlapped path, or None."""
    if not getattr(module, "sequence_parallel", False):
        return "no sequence parallelism (TP=1 or sequence_parallel=False): nothing to overlap"
    if getattr(module, "explicit_expert_comm", False):
        return "expert layer with explicit communication"
    if getattr(module, "gradient_accumulation_fusion", False):
        return "gradient_accumulation_fusion is on; set it False to overlap"
    config = getattr(module, "config", None)
    if config is not None and getattr(config, "defer_embedding_wgrad_compute", False):
        return "defer_embedding_wgrad_compute is on"
    return None


def _column_forward_impl(*, chunks: int, overlap: bool):
    def forward_impl(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     *, tp_group: Any = None, sequence_parallel: bool = True, **_unused: Any) -> torch.Tensor:
        # megatron-core passes allreduce_dgrad=False, gradient_accumulation_fusion=False,
        # grad_output_buffer=None, ... for layers overlap_refusal accepted; they need no action.
        out = all_gather_linear(input, weight, group=tp_group, chunks=chunks, overlap=overlap)
        return out + bias if bias is not None else out

    return forward_impl


def _row_forward(self, input_: torch.Tensor):
    out = linear_reduce_scatter(input_, self.weight, group=self.tp_group, chunks=self._het_overlap.chunks,
                                overlap=self._het_overlap.overlap)
    if self.skip_bias_add:
        return out, self.bias
    return (out + self.bias if self.bias is not None else out), None


def apply_tp_comm_overlap(model: torch.nn.Module, *, chunks: int = 4, overlap: bool = True) -> OverlapReport:
    """Switch every eligible megatron-core TP linear layer of ``model`` to the overlapped path.

    Idempotent (a second call updates ``chunks``). Returns what was switched and what was not.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    cfg = OverlapConfig(chunks=chunks, overlap=overlap)
    done, skipped = [], []
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        why = overlap_refusal(module)
        if why is not None:
            skipped.append((name, why))
            continue
        module._het_overlap = cfg
        if isinstance(module, ColumnParallelLinear):
            module._forward_impl = _column_forward_impl(chunks=cfg.chunks, overlap=cfg.overlap)
        else:
            module.forward = types.MethodType(_row_forward, module)
        done.append(name)
    return OverlapReport(chunks=cfg.chunks, overlapped=tuple(done), skipped=tuple(skipped))
