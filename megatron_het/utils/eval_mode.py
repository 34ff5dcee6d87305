"""Modules in evaluation mode for a forward-only pass (validation), restored afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

__all__ = ["eval_mode"]


@contextlib.contextmanager
def eval_mode(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Dropout off while validating, as Megatron-LM's evaluate() calls ``model.eval()``; each module's
    own mode comes back afterwards, also when the pass fails."""
    modules = list(modules)
    was = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, training in zip(modules, was):
            m.train(training)
