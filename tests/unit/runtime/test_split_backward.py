"""The B/W split computes what it says (#16): B the input gradients with one traversal, W the linears'
weight gradients from what B kept, together equal to the fused backward (fp32, 1e-6 relative)."""

from __future__ import annotations

import pytest
import torch

from megatron_het.runtime.split_backward import WeightGradStore, deferred_linear


def _model(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(32, 16, generator=g).requires_grad_()
    b1 = torch.randn(32, generator=g).requires_grad_()
    norm = torch.randn(32, generator=g).requires_grad_()  # an element-wise parameter (stays in B)
    w2 = torch.randn(8, 32, generator=g).requires_grad_()
    x = torch.randn(4, 3, 16, generator=g).requires_grad_()
    return x, [w1, b1, norm, w2]


def _forward(x, params, store):
    w1, b1, norm, w2 = params
    h = torch.tanh(deferred_linear(x, w1, b1, store)) * norm
    return deferred_linear(h, w2, None, store).square().sum()


def test_b_then_w_equals_the_fused_backward_and_b_defers_only_the_linear_weights():
    store = WeightGradStore()
    x, params = _model()
    _forward(x, params, store).backward()  # fused: no deferring key
    fused = [p.grad.clone() for p in params]
    fused_dx = x.grad.clone()

    x2, params2 = _model()
    loss = _forward(x2, params2, store)
    with store.deferring((0, 3)):
        loss.backward()
    w1, b1, norm, w2 = params2
    assert w1.grad is None and b1.grad is None and w2.grad is None  # left to W
    torch.testing.assert_close(norm.grad, fused[2], rtol=1e-6, atol=0)  # element-wise: done in B
    torch.testing.assert_close(x2.grad, fused_dx, rtol=1e-6, atol=0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()  # B freed the graph: W cannot (and does not) traverse it again
    flushed = store.flushed
    assert store.flush((0, 3)) == 2 and store.flushed == flushed + 2
    for got, want in zip(params2, fused):
        torch.testing.assert_close(got.grad, want, rtol=1e-6, atol=1e-6)
    assert store.pending == {}


def test_w_accumulates_through_autograd_so_gradient_hooks_fire():
    store = WeightGradStore()
    x, params = _model(1)
    seen = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: seen.append(i))
    with store.deferring("k"):
        _forward(x, params, store).backward()
    assert seen == [2]  # only the element-wise parameter is final after B
    store.flush("k")
    assert sorted(seen) == [0, 1, 2, 3]


def test_keys_are_independent_and_discard_forgets():
    store = WeightGradStore()
    x, params = _model(2)
    with store.deferring((0, 0)):
        _forward(x, params, store).backward()
    with store.deferring((1, 0)):
        _forward(x.detach().requires_grad_(), params, store).backward()
    assert set(store.pending) == {(0, 0), (1, 0)}
    assert store.flush((1, 0)) == 2 and set(store.pending) == {(0, 0)}
    store.discard()
    assert store.pending == {} and store.key is None


def test_w_in_any_order_gives_the_same_sums():
    grads = []
    for order in (0, 1):
        store = WeightGradStore()
        x, params = _model(3)
        for k in range(3):
            with store.deferring(k):
                _forward(x * (k + 1), params, store).backward()
        for k in (range(3) if order == 0 else reversed(range(3))):  # W order is free (bubble filling)
            store.flush(k)
        grads.append([p.grad.clone() for p in params])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
