"""optim/norms.sum_of_squares_f64: float64 sums of squares in bounded chunks (no float64 copy of a
whole gradient), equal to the one-shot float64 sum."""

from __future__ import annotations

import pytest
import torch

from megatron_het.optim.norms import sum_of_squares_f64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_sum_equals_the_whole_float64_sum(dtype):
    torch.manual_seed(0)
    t = (torch.randn(1000, 37) * 3).to(dtype)
    exact = t.double().pow(2).sum()
    for chunk in (1, 7, 1000, 37000, 10 ** 9):
        got = sum_of_squares_f64(t, chunk=chunk)
        assert got.dtype == torch.float64
        assert abs(got.item() - exact.item()) <= 1e-12 * exact.item(), chunk


def test_chunks_bound_the_temporaries(monkeypatch):
    sizes = []
    real = torch.Tensor.double

    def spy(self):
        sizes.append(self.numel())
        return real(self)

    monkeypatch.setattr(torch.Tensor, "double", spy)
    sum_of_squares_f64(torch.ones(10_000), chunk=1024)
    assert max(sizes) == 1024 and sum(sizes) == 10_000
    with pytest.raises(ValueError, match="chunk"):
        sum_of_squares_f64(torch.ones(3), chunk=0)
