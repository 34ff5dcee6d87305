"""Split backward (B = input gradient, W = weight gradient) gives the fused backward's gradients."""

from __future__ import annotations

import torch

from megatron_het.runtime.executor import backward_input, backward_weight


class Stage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.b(torch.nn.functional.gelu(self.a(x))) + x)


def _grads(split: bool, order: str):
    torch.manual_seed(0)
    stage = Stage()
    params = list(stage.parameters())
    inputs = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
    out_grads = [torch.randn(4, 8) for _ in range(3)]
    outs = [stage(x) for x in inputs]
    if not split:
        for out, g in zip(outs, out_grads):
            torch.autograd.backward(out, grad_tensors=g)
    else:
        for out, g, x in zip(outs, out_grads, inputs):
            backward_input(out, g, x)
            assert all(p.grad is None for p in params), "B must not touch weight gradients"
        ws = list(zip(outs, out_grads))
        for out, g in (reversed(ws) if order == "reversed" else ws):  # W order is free (bubble filling)
            backward_weight(out, g, params)
    return [x.grad.clone() for x in inputs], [p.grad.clone() for p in params]


def test_split_equals_fused_in_any_w_order():
    fused_in, fused_w = _grads(False, "")
    for order in ("same", "reversed"):
        split_in, split_w = _grads(True, order)
        for a, b in zip(split_in + split_w, fused_in + fused_w):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), float((a - b).abs().max())


def test_first_stage_without_input_puts_everything_in_w():
    torch.manual_seed(1)
    stage = Stage()
    out = stage(torch.randn(4, 8)).sum()
    backward_input(out, None, None)
    assert all(p.grad is None for p in stage.parameters())
    backward_weight(out, None, list(stage.parameters()))
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in stage.parameters())
