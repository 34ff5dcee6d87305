"""How far a run's final parameters are from a reference's, per tensor (the parity tests' parameter metric)."""

from __future__ import annotations

import torch


def relative_norms(final: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor ||p - p_ref||_2 / ||p_ref||_2 (Frobenius norms over the whole tensor, computed in float64).

    Unlike max|diff| / max|ref| this does not make one element's round-off the whole tensor's figure, and
    unlike an element-wise relative bound it is defined for parameters that are (near) zero somewhere."""
    out = {}
    for k, want in ref.items():
        w, got = want.double(), final[k].double()
        out[k] = float((got - w).norm() / max(float(w.norm()), 1e-300))
    return out
