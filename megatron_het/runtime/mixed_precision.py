"""Mixed precision as Megatron-LM does it, on the heterogeneous gradient layout.

Megatron's pieces and what this runtime uses of them:

- ``megatron.core.transformer.module.Float16Module`` wraps the stage: parameters in bf16/fp16,
  first-stage inputs cast down, last-stage outputs (the per-token losses) cast up to fp32. Used as is;
  a stage that is not its replica's last keeps its output in half precision (``fp32_output=False``),
  so boundary messages are half precision like Megatron's ``pipeline_dtype``.
- fp32 main parameters and main gradients (Megatron's ``Float16OptimizerWithFloat16Params`` with
  DDP's ``main_grad`` buffers and ``--accumulate-allreduce-grads-in-fp32``): here ``MainParams``.
  Megatron's optimizer class is not used because it reads its gradients from megatron's DDP buffers
  and reduces over a uniform DP group, while this runtime reduces each parameter over its *holders*
  (replicas of different TP sizes; ``grad_sync.py``). So each half-precision gradient is added into an
  fp32 main gradient as soon as autograd produces it (fp32 accumulation over micro-batches), the
  synchronizer reduces the fp32 main gradients, AdamW updates the fp32 main parameters, and the
  result is copied back into the model (Megatron's ``_copy_main_params_to_model_params``).
- ``megatron.core.optimizer.grad_scaler`` (``DynamicGradScaler`` / ``ConstantGradScaler``): used as is
  for fp16; the overflow check is torch's ``_amp_foreach_non_finite_check_and_unscale_`` (what
  Megatron's ``_unscale_main_grads_and_check_for_nan`` calls), agreed over the whole world. With the
  distributed optimizer it unscales the reduced fp32 pieces each rank owns, as Megatron's distributed
  optimizer unscales its main-gradient shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_het.runtime.comm_routing import all_reduce_world

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def params_dtype(precision: str) -> torch.dtype:
    return DTYPES[precision]


def wrap_float16(config, gpt):
    """megatron-core's Float16Module around ``gpt`` (converts it in place to bf16/fp16)."""
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, gpt)


class MainParams:
    """fp32 main copies of a stage's half-precision parameters, each with an fp32 main gradient.

    ``model``: the stage's parameters by global name (half precision). The main parameters carry
    their gradient in ``.grad`` (always allocated, zeroed each step), so the gradient synchronizer,
    the global norm and AdamW work on them exactly as on fp32 model parameters.
    """

    def __init__(self, model: Mapping[str, torch.nn.Parameter], *, main: Mapping[str, torch.nn.Parameter] | None = None):
        self.model = dict(model)
        if main is None:
            main = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in self.model.items()}
            for m in main.values():
                m.grad = torch.zeros_like(m)
        self.main = dict(main)
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate(self.main[n]))
                       for n, p in self.model.items()]

    @staticmethod
    def _accumulate(main: torch.nn.Parameter):
        def hook(p: torch.Tensor) -> None:  # fp32 accumulation: the half-precision grad lives one backward
            main.grad.add_(p.grad)
            p.grad = None
        return hook

    @staticmethod
    def _accumulate_into(buffer: torch.Tensor):
        def hook(p: torch.Tensor) -> None:
            buffer.add_(p.grad)
            p.grad = None
        return hook

    def rebind(self, model: Mapping[str, torch.nn.Parameter]) -> MainParams:
        """The same main parameters (and optimizer state keyed by them) over a rebuilt model."""
        self.remove_hooks()
        return MainParams(model, main=self.main)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def zero_grad(self) -> None:
        for m in self.main.values():
            m.grad.zero_()
        for p in self.model.values():
            p.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for n, p in self.model.items():
            p.copy_(self.main[n])


class MainGrads:
    """fp32 main gradients only, for the distributed optimizer (``optim/distributed.py``), which keeps
    the fp32 main values as shards: no full fp32 copy of the parameters exists on any rank.

    Same hooks as ``MainParams`` (each half-precision gradient added into its fp32 buffer as autograd
    produces it, then freed). ``main`` is empty (no full main parameters for the norm, the scaler or
    the checkpoint to walk); ``copy_to_model`` is a no-op because the optimizer's all-gather writes
    the model parameters.
    """

    def __init__(self, model: Mapping[str, torch.nn.Parameter]):
        self.model = dict(model)
        self.main: dict[str, torch.nn.Parameter] = {}
        self.grads = {n: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for n, p in self.model.items()}
        self._hooks = [p.register_post_accumulate_grad_hook(MainParams._accumulate_into(self.grads[n]))
                       for n, p in self.model.items()]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def zero_grad(self) -> None:
        for g in self.grads.values():
            g.zero_()
        for p in self.model.values():
            p.grad = None

    def copy_to_model(self) -> None:
        """Nothing to copy: the distributed optimizer writes the model parameters itself."""


class LossScaler:
    """fp16 loss scaling with megatron-core's grad scaler; agreed overflow over the world."""

    def __init__(self, train, device: torch.device) -> None:
        from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

        if train.loss_scale is not None:
            self.scaler = ConstantGradScaler(train.loss_scale)
        else:
            self.scaler = DynamicGradScaler(initial_scale=train.initial_loss_scale, min_scale=train.min_loss_scale,
                                            growth_factor=2.0, backoff_factor=0.5,
                                            growth_interval=train.loss_scale_window, hysteresis=train.hysteresis)
        self.device = device
        self.skipped = 0  # steps skipped on overflow, over the run

    @property
    def scale(self) -> torch.Tensor:
        return self.scaler.scale.to(self.device)

    def unscale_and_check(self, grads: Sequence[torch.Tensor]) -> bool:
        """Divide this rank's fp32 main gradients (full main gradients, or the distributed optimizer's
        reduced pieces) by the scale; True when any rank saw inf/NaN (collective). One host read per
        step: whether to step, as Megatron's ``found_inf.item()``."""
        found = torch.zeros(1, dtype=torch.float32, device=self.device)
        grads = [g for g in grads if g.numel()]
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, self.scaler.inv_scale.to(self.device))
        all_reduce_world(found, op=dist.ReduceOp.MAX)
        overflow = bool(found.item() > 0)
        self.scaler.update(overflow)
        self.skipped += int(overflow)
        return overflow
