"""Deterministic synthetic token batches: sample i of iteration t is the same on every plan.

Parity tests need every plan to see exactly the same samples; generating each sample from its own
seed (not from a shared stream) makes that independent of how the batch is split.
"""

from __future__ import annotations

import torch


def synthetic_sample(*, seed: int, iteration: int, index: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    """Tokens of one sample, length seq_length + 1 (inputs and shifted labels)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + iteration * 10_007 + index)
    return torch.randint(0, vocab_size, (seq_length + 1,), generator=g)


def synthetic_batch(*, seed: int, iteration: int, indices: range | list[int], seq_length: int,
                    vocab_size: int) -> torch.Tensor:
    """Rows ``indices`` of iteration ``iteration``'s global batch, shape [len(indices), seq_length + 1]."""
    return torch.stack([synthetic_sample(seed=seed, iteration=iteration, index=i,
                                         seq_length=seq_length, vocab_size=vocab_size) for i in indices])
