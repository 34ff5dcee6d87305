"""Byte-level BPE tokenizers trained on the shipped corpus, as GPT-2's files (vocab.json, merges.txt)
and as a HuggingFace tokenizer directory: what a Megatron-LM user's existing data was tokenized with,
made here because nothing is downloaded (the `tokenizers` library trains them in about a second)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from support.paths import REPO

CORPUS = REPO / "examples" / "data" / "corpus.jsonl"
EOD = "<|endoftext|>"


def corpus_head(root: Path, documents: int = 200) -> Path:
    """The first ``documents`` lines of the shipped corpus as a JSONL file under ``root``."""
    head = root / "corpus.jsonl"
    with CORPUS.open(encoding="utf-8") as lines:
        head.write_text("".join(itertools.islice(lines, documents)), encoding="utf-8")
    return head


def bpe_files(root: Path, *, documents: int = 200, vocab_size: int = 600) -> tuple[Path, Path, Path]:
    """(vocab.json, merges.txt, HuggingFace tokenizer directory) of one BPE trained on the corpus head."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for line in corpus_head(root, documents).read_text().splitlines()]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOD], show_progress=False)
    vocab, merges = bpe.save_model(str(root))
    hf = root / "hf"
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOD, bos_token=EOD,
                            unk_token=EOD).save_pretrained(str(hf))
    return Path(vocab), Path(merges), hf
