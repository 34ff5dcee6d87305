"""Say on stderr which ``--profile`` files plan.py / predict.py will not use, and why.

The predictor picks a profile by device type (and island) and its layer times by layer shape
(perf/predict.py profile_for, perf/profile.py lookup); a profile that matches neither is priced
from the catalog instead, which a user who passed it would not guess. This only reports: pricing
is unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import fields
from typing import TextIO

from megatron_het.cluster import ClusterSpec, ModelSpec
from megatron_het.perf.profile import Profile, ProfileEntry, layer_shape

__all__ = ["unused_profile_reasons", "warn_unused_profiles"]

_MOE_SHAPE = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
              "moe_token_dispatcher_type")
_SHAPE = ("hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "swiglu", "seq_length",
          *_MOE_SHAPE)
# what a dense layer's entry holds in the MoE keys: ProfileEntry's defaults
_DENSE = {f.name: f.default for f in fields(ProfileEntry) if f.name in _MOE_SHAPE}


def _shape_text(values: Sequence[object]) -> str:
    shown = [f"{k}={v}" for k, v in zip(_SHAPE, values) if _DENSE.get(k, object()) != v]
    return ", ".join(shown) + ("" if any(k == "num_experts" for k, v in zip(_SHAPE, values) if v) else
                               " (a dense layer)")


def _wanted(model: ModelSpec) -> tuple[object, ...]:
    """The model's layer shape in _SHAPE's keys (perf.profile.layer_shape: an MoE model's MoE layer)."""
    shape = {**_DENSE, **layer_shape(model), "seq_length": model.seq_length}
    return tuple(shape[k] for k in _SHAPE)


def unused_profile_reasons(profiles: Sequence[Profile] | None, model: ModelSpec,
                           cluster: ClusterSpec) -> list[str]:
    """One sentence per profile the predictor will not use (or not use the layer times of)."""
    reasons = []
    devices = list(dict.fromkeys(island.device.name for island in cluster.islands))
    islands = {island.name for island in cluster.islands}
    wanted = _wanted(model)
    for i, p in enumerate(profiles or ()):
        name = p.source or f"profile #{i + 1}"
        if p.device not in devices:
            reasons.append(f"profile {name} not used: it was measured on device {p.device!r}, which no island of "
                           f"the cluster has (its devices: {', '.join(devices)})")
        elif p.island is not None and p.island not in islands:
            reasons.append(f"profile {name} not used: it was measured for island {p.island!r}, which the cluster "
                           f"does not have (its islands: {', '.join(sorted(islands))})")
        elif not p.compute_model and p.entries and not any(
                tuple(getattr(e, k) for k in _SHAPE) == wanted for e in p.entries):
            measured = sorted({tuple(getattr(e, k) for k in _SHAPE) for e in p.entries}, key=str)
            reasons.append(f"profile {name}: its layer times not used: measured for {_shape_text(measured[0])}"
                           f"{' (and other shapes)' if len(measured) > 1 else ''} but the model's layers are "
                           f"{_shape_text(wanted)}")
    return reasons


def warn_unused_profiles(profiles: Sequence[Profile] | None, model: ModelSpec, cluster: ClusterSpec, *,
                         prog: str, stream: TextIO | None = None) -> None:
    """Print :func:`unused_profile_reasons`, one line each, prefixed with ``prog``, on stderr."""
    for reason in unused_profile_reasons(profiles, model, cluster):
        print(f"{prog}: warning: {reason}", file=stream or sys.stderr)
