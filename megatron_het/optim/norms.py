"""Squared gradient norms in float64 without a float64 copy of the gradient.

``g.double().pow(2).sum()`` materialises two float64 temporaries the size of ``g`` (3.5 GB for a
220M-element shard): on a GPU near its memory limit, clipping alone could run it out. Chunks of
``CHUNK`` elements bound the temporaries while keeping every square and sum in float64.
"""

from __future__ import annotations

import torch

CHUNK = 1 << 24  # elements per float64 temporary (128 MiB)


def sum_of_squares_f64(t: torch.Tensor, *, chunk: int = CHUNK) -> torch.Tensor:
    """``sum(t ** 2)`` in float64, on ``t``'s device, with temporaries of at most ``chunk`` elements."""
    if chunk < 1:
        raise ValueError(f"chunk: must be >= 1 (got {chunk}). Fix: pass a positive element count")
    flat = t.detach().reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for piece in flat.split(chunk):
        total += piece.double().square().sum()
    return total
