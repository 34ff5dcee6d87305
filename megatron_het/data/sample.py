"""A small real dataset from the first documents of a corpus: a SentencePiece tokenizer trained on them
and megatron-core's indexed dataset, as `make demo` makes (the fresh-start tests and bench use it)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["sample_dataset"]


def sample_dataset(corpus: Path, root: Path, *, documents: int = 200, vocab_size: int = 512) -> tuple[str, str]:
    """(dataset prefix for --data-path, tokenizer model for --tokenizer-model), written under ``root``
    from the first ``documents`` lines of ``corpus`` (JSONL, a "text" key)."""
    from megatron_het.data.preprocess import PreprocessConfig, preprocess
    from megatron_het.data.tokenizer import TokenizerTrainConfig, train_tokenizer

    with Path(corpus).open(encoding="utf-8") as lines:
        subset = [line for line, _ in zip(lines, range(documents))]
    head = Path(root) / "corpus.jsonl"
    head.write_text("".join(subset), encoding="utf-8")
    model = train_tokenizer(TokenizerTrainConfig(input=head, output_prefix=Path(root) / f"sp{vocab_size}",
                                                 vocab_size=vocab_size)).model_path
    report = preprocess(PreprocessConfig(input=head, output_prefix=str(Path(root) / "corpus"), tokenizer_model=model,
                                         append_eod=True))
    return report.prefixes["text"], str(model)
