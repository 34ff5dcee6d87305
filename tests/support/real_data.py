"""A small real dataset for tests that follow a user's run: the shipped corpus (its first documents),
a SentencePiece tokenizer trained on them and megatron-core's indexed dataset, as `make demo` makes."""

from __future__ import annotations

from pathlib import Path

from support.paths import EXAMPLES


def make_real_data(root: Path, *, documents: int = 200, vocab_size: int = 512) -> tuple[str, str]:
    """(dataset prefix for --data-path, tokenizer model for --tokenizer-model) under ``root``."""
    from megatron_het.data.preprocess import PreprocessConfig, preprocess
    from megatron_het.data.tokenizer import TokenizerTrainConfig, train_tokenizer

    with (EXAMPLES / "data" / "corpus.jsonl").open(encoding="utf-8") as lines:
        subset = [line for line, _ in zip(lines, range(documents))]
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(subset), encoding="utf-8")
    model = train_tokenizer(TokenizerTrainConfig(input=corpus, output_prefix=root / f"sp{vocab_size}",
                                                 vocab_size=vocab_size)).model_path
    report = preprocess(PreprocessConfig(input=corpus, output_prefix=str(root / "corpus"), tokenizer_model=model,
                                         append_eod=True))
    return report.prefixes["text"], str(model)
