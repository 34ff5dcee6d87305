"""JSONL -> megatron-core indexed dataset (.bin/.idx), as Megatron-LM's tools/preprocess_data.py.

One document per JSONL line and per json key, one sequence per document (no sentence splitting);
with ``append_eod`` the tokenizer's eod id ends every document so GPTDataset samples that span two
documents keep the boundary. Output prefix per key: ``{output_prefix}_{key}_document``.
Writing goes through megatron-core's ``IndexedDatasetBuilder``, so the files are exactly what
``GPTDataset`` reads. Both files are written under temporary names (``.bin.tmp``/``.idx.tmp``) next
to their final ones, fsynced, and renamed only when every key succeeded (``.bin`` then ``.idx``, two
adjacent renames): a failed or killed run leaves an existing dataset untouched.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from megatron_het.data.jsonl import DataInputError, read_jsonl_texts, require_file
from megatron_het.data.tokenizer import TokenizerSpec, build_gpt_tokenizer
from megatron_het.utils.progress import ProgressCallback

# Documents per worker task: large enough to amortise loading the tokenizer in each task.
CHUNK_DOCUMENTS = 64
TMP_SUFFIX = ".tmp"  # files being written; renamed over the final names only on success


@dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    """Megatron-LM preprocess_data.py arguments (same names, Python types)."""

    input: Path  # JSONL file
    json_keys: tuple[str, ...] = ("text",)  # each key becomes its own dataset
    output_prefix: str  # files are {output_prefix}_{key}_document.bin/.idx
    tokenizer_type: str = "SentencePieceTokenizer"  # data.tokenizer.GPT_TOKENIZER_TYPES
    tokenizer_model: Path | None = None  # SentencePiece .model file or HuggingFace tokenizer directory
    vocab_file: Path | None = None  # GPT2BPETokenizer's vocab.json
    merge_file: Path | None = None  # GPT2BPETokenizer's merges.txt
    vocab_size: int | None = None  # --vocab-size: NullTokenizer's id bound, TikTokenizer's vocabulary (specials included)
    append_eod: bool = False  # end every document with the eod token
    workers: int = 1  # processes that tokenize; 1 tokenizes in this process

    def __post_init__(self) -> None:
        if not self.json_keys:
            raise DataInputError("json_keys: got an empty list. Fix: pass --json-keys text (or your key).")
        if len(set(self.json_keys)) != len(self.json_keys):
            raise DataInputError(f"json_keys: got {list(self.json_keys)} with repeats. Fix: list each key once.")
        if self.workers < 1:
            raise DataInputError(f"workers: got {self.workers}, the minimum is 1. Fix: pass --workers 1 or more.")
        if not self.output_prefix:
            raise DataInputError("output_prefix: got ''. Fix: pass --output-prefix PATH/NAME.")
        self.tokenizer  # validates the tokenizer flags before any work

    @property
    def tokenizer(self) -> TokenizerSpec:
        """The tokenizer flags (Megatron-LM's --tokenizer-type and the files it reads)."""
        as_str = {k: None if v is None else str(v) for k, v in (("tokenizer_model", self.tokenizer_model),
                                                                 ("vocab_file", self.vocab_file),
                                                                 ("merge_file", self.merge_file))}
        return TokenizerSpec(tokenizer_type=self.tokenizer_type, vocab_size=self.vocab_size, **as_str)


@dataclass(frozen=True, kw_only=True)
class PreprocessReport:
    """What was written."""

    prefixes: Mapping[str, str]  # json key -> dataset prefix (pass as --data-path)
    documents: int  # documents written per key
    tokens: Mapping[str, int]  # json key -> tokens written (eod included)
    skipped_empty: int  # lines whose text tokenized to nothing and carried no eod (not written)


def dataset_prefix(output_prefix: str, key: str) -> str:
    """Megatron-LM's naming: ``{output_prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def encode_chunk(task: tuple[TokenizerSpec, tuple[str, ...], bool, list[dict[str, str]]]) -> list[dict[str, list[int]]]:
    """Token ids per key for a chunk of documents (a top-level function so worker processes can run it)."""
    spec, keys, append_eod, records = task
    tokenizer = build_gpt_tokenizer(spec)
    out = []
    for record in records:
        ids = {}
        for key in keys:
            tokens = list(tokenizer.tokenize(record[key]))
            if append_eod:
                tokens.append(tokenizer.eod)
            ids[key] = tokens
        out.append(ids)
    return out


def _chunks(config: PreprocessConfig) -> Iterator[tuple[TokenizerSpec, tuple[str, ...], bool, list[dict[str, str]]]]:
    records = (texts for _, texts in read_jsonl_texts(config.input, config.json_keys))
    while chunk := list(itertools.islice(records, CHUNK_DOCUMENTS)):
        yield (config.tokenizer, config.json_keys, config.append_eod, chunk)


def count_documents(path: Path) -> int:
    """Non-blank lines of a JSONL file (one cheap pass; the total of a progress display)."""
    with path.open("rb") as lines:
        return sum(1 for line in lines if line.strip())


def check_output_prefix(output_prefix: str, keys: tuple[str, ...]) -> None:
    """Refuse an output prefix whose files cannot be written (before any work is done)."""
    parent = Path(output_prefix).parent
    for up in (parent, *parent.parents):  # the nearest existing ancestor must be a directory
        if up.exists():
            if not up.is_dir():
                raise DataInputError(f"output_prefix: {output_prefix!r}: {str(up)!r} is a file, not a directory. "
                                     f"Fix: pass --output-prefix inside a directory")
            break
    for key in keys:
        for ext in (".bin", ".idx"):
            target = Path(dataset_prefix(output_prefix, key) + ext)
            if target.is_dir():
                raise DataInputError(f"output_prefix: {str(target)!r} is a directory. "
                                     f"Fix: pass another --output-prefix or remove that directory")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def preprocess(config: PreprocessConfig, *, progress: ProgressCallback | None = None) -> PreprocessReport:
    """Tokenize ``config.input`` and write one .bin/.idx pair per json key (atomically, see module doc).

    ``progress(done, total)`` is called after each chunk of documents (empty ones included).
    """
    require_file(config.input, field="input", fix="pass --input with an existing JSONL file.")
    check_output_prefix(config.output_prefix, config.json_keys)
    total = count_documents(config.input) if progress is not None else 0
    tokenizer = build_gpt_tokenizer(config.tokenizer)
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(tokenizer.vocab_size)  # uint16 below 65500 pieces, as Megatron-LM
    prefixes = {key: dataset_prefix(config.output_prefix, key) for key in config.json_keys}
    temps = {key: (prefix + ".bin" + TMP_SUFFIX, prefix + ".idx" + TMP_SUFFIX) for key, prefix in prefixes.items()}
    Path(config.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    builders = {}
    tokens = dict.fromkeys(config.json_keys, 0)
    documents = skipped = 0
    pool = get_context("fork").Pool(config.workers) if config.workers > 1 else None
    try:
        for key, (tmp_bin, _) in temps.items():
            builders[key] = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
        encoded = pool.imap(encode_chunk, _chunks(config)) if pool else map(encode_chunk, _chunks(config))
        for chunk in encoded:
            for ids in chunk:
                if not all(ids.values()):  # an empty sequence would give GPTDataset a zero-length document
                    skipped += 1
                    continue
                for key, seq in ids.items():
                    builders[key].add_document(numpy.asarray(seq, dtype=numpy.int64), [len(seq)])
                    tokens[key] += len(seq)
                documents += 1
            if progress is not None:
                progress(documents + skipped, total)
        if documents == 0:
            raise DataInputError(f"input: {str(config.input)!r} produced no non-empty documents ({skipped} empty). "
                                 f"Fix: pass a JSONL file with text under {list(config.json_keys)}.")
        for key, builder in builders.items():
            builder.finalize(temps[key][1])
            for path in temps[key]:
                _fsync(path)
    except BaseException:
        for builder in builders.values():  # remove only our temporary files; the old dataset stays
            builder.data_file.close()
        for pair in temps.values():
            for path in pair:
                Path(path).unlink(missing_ok=True)
        raise
    finally:
        if pool:
            pool.close()
            pool.join()
    for key, (tmp_bin, tmp_idx) in temps.items():  # .idx last: it is what makes the pair readable
        os.replace(tmp_bin, prefixes[key] + ".bin")
        os.replace(tmp_idx, prefixes[key] + ".idx")
    _fsync(str(Path(config.output_prefix).parent))
    return PreprocessReport(prefixes=prefixes, documents=documents, tokens=tokens, skipped_empty=skipped)
