"""A small real dataset for tests that follow a user's run: the shipped corpus (its first documents),
a SentencePiece tokenizer trained on them and megatron-core's indexed dataset, as `make demo` makes."""

from __future__ import annotations

from pathlib import Path

from megatron_het.data.sample import sample_dataset

from support.paths import EXAMPLES


def make_real_data(root: Path, *, documents: int = 200, vocab_size: int = 512) -> tuple[str, str]:
    """(dataset prefix for --data-path, tokenizer model for --tokenizer-model) under ``root``."""
    return sample_dataset(EXAMPLES / "data" / "corpus.jsonl", root, documents=documents, vocab_size=vocab_size)
