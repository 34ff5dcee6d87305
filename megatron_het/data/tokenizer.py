"""Train a small SentencePiece model and load it through megatron-core's tokenizer interface.

Choices (why):
- BPE, not unigram: deterministic for a given corpus and fast to train (well under a second for
  the shipped 1 MB corpus at vocab 512).
- ``identity`` normalization, extra whitespace kept, ``byte_fallback``: every UTF-8 string
  (newlines, indentation, rare characters) encodes and decodes back to itself, so a preprocessed
  corpus can be checked document by document.
- Fixed special ids unk=0, bos=1, eos=2, pad=3: eos is the end-of-document (eod) token that
  ``--append-eod`` writes; pad is distinct from eod so megatron-core's GPTDataset never mistakes
  real text for padding.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import megatron_het.platform  # noqa: F401  (triton import guard before the lazy megatron.core imports below)
from megatron_het.data.jsonl import DataInputError, read_jsonl_texts, require_file
from megatron_het.utils.atomic import write_bytes_atomic

if TYPE_CHECKING:
    from megatron.core.tokenizers import MegatronTokenizerBase

# Megatron-LM's --tokenizer-type values that mean "a SentencePiece model file".
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
# Every --tokenizer-type Megatron-LM's GPT path takes (megatron-core's build_tokenizer builds them)
GPT_TOKENIZER_TYPES = (*SENTENCEPIECE_TYPES, "GPT2BPETokenizer", "HuggingFaceTokenizer", "TikTokenizer",
                       "NullTokenizer")
MODEL_TYPES = ("bpe", "unigram")
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
# 256 byte-fallback pieces + 4 special pieces + at least one learned piece.
MIN_VOCAB_SIZE = 261
# Above this the .bin token dtype switches from uint16 to int32; tiny corpora cannot fill it anyway.
MAX_VOCAB_SIZE = 65_500


@dataclass(frozen=True, kw_only=True)
class TokenizerTrainConfig:
    """What to train the SentencePiece model on and where to write it."""

    input: Path  # JSONL corpus, one object per line
    json_key: str = "text"  # key of the document text in each line
    vocab_size: int = 512  # number of pieces, including 256 byte pieces and 4 special ones
    output_prefix: Path  # writes {output_prefix}.model and {output_prefix}.vocab
    model_type: str = "bpe"  # "bpe" (default, deterministic) or "unigram"
    character_coverage: float = 0.9995  # share of characters given own pieces; the rest fall back to bytes

    def __post_init__(self) -> None:
        if not MIN_VOCAB_SIZE <= self.vocab_size <= MAX_VOCAB_SIZE:
            raise DataInputError(f"vocab_size: got {self.vocab_size}, allowed {MIN_VOCAB_SIZE}..{MAX_VOCAB_SIZE} "
                             f"(256 byte pieces + 4 special pieces need at least {MIN_VOCAB_SIZE}). "
                             "Fix: pass --vocab-size in that range, e.g. 512.")
        if self.model_type not in MODEL_TYPES:
            raise DataInputError(f"model_type: got {self.model_type!r}, expected one of {MODEL_TYPES}. "
                             "Fix: pass --model-type bpe or --model-type unigram.")
        if not 0.9 <= self.character_coverage <= 1.0:
            raise DataInputError(f"character_coverage: got {self.character_coverage}, allowed 0.9..1.0. "
                             "Fix: pass a value such as 0.9995 (rare characters fall back to bytes).")


@dataclass(frozen=True, kw_only=True)
class TokenizerTrainReport:
    """What training produced."""

    model_path: Path  # the SentencePiece model (pass as --tokenizer-model)
    vocab_path: Path  # human-readable piece list with scores
    vocab_size: int  # pieces in the trained model
    num_documents: int  # documents read from the corpus


def train_tokenizer(config: TokenizerTrainConfig) -> TokenizerTrainReport:
    """Train a SentencePiece model on the documents of ``config.input``; deterministic for BPE."""
    import sentencepiece as spm

    _check_output_prefix(Path(config.output_prefix))
    texts = [t[config.json_key] for _, t in read_jsonl_texts(config.input, (config.json_key,))]
    if not texts:
        raise DataInputError(f"input: {str(config.input)!r} holds no documents. "
                             "Fix: pass a JSONL file with at least one non-empty line.")
    longest = max(len(t.encode("utf-8")) for t in texts)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_writer=model, vocab_size=config.vocab_size,
            model_type=config.model_type, character_coverage=config.character_coverage,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, byte_fallback=True, split_digits=True,
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
            max_sentence_length=max(longest, 4192),  # default 4192 would silently drop long documents
            num_threads=1, minloglevel=2)
    except RuntimeError as err:  # e.g. "Vocabulary size too high" on a small corpus
        raise DataInputError(f"vocab_size: SentencePiece could not train {config.vocab_size} pieces on "
                         f"{len(texts)} documents ({err}). Fix: change --vocab-size as that message says "
                         "(it needs room for 260 fixed pieces plus the corpus's characters, and cannot "
                         "learn more pieces than the corpus holds).") from None
    prefix = Path(config.output_prefix)
    model_path = prefix.with_name(prefix.name + ".model")
    vocab_path = prefix.with_name(prefix.name + ".vocab")
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    listing = "".join(f"{_escape(processor.id_to_piece(i))}\t{processor.get_score(i):g}\n"
                      for i in range(processor.get_piece_size()))
    prefix.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(model_path, model.getvalue())
    write_bytes_atomic(vocab_path, listing.encode("utf-8"))
    return TokenizerTrainReport(model_path=model_path, vocab_path=vocab_path,
                                vocab_size=processor.get_piece_size(), num_documents=len(texts))


def _check_output_prefix(prefix: Path) -> None:
    """Refuse, before training, an output prefix whose files cannot be written."""
    for up in prefix.parents:  # the nearest existing ancestor must be a directory
        if up.exists():
            if not up.is_dir():
                raise DataInputError(f"output_prefix: {str(prefix)!r}: {str(up)!r} is a file, not a directory. "
                                     "Fix: pass --output-prefix inside a directory.")
            break
    for suffix in (".model", ".vocab"):
        target = prefix.with_name(prefix.name + suffix)
        if target.is_dir():
            raise DataInputError(f"output_prefix: {str(target)!r} is a directory. "
                                 "Fix: pass another --output-prefix or remove that directory.")


def _escape(piece: str) -> str:
    """Keep one piece per line in the .vocab listing (pieces may hold newlines or tabs)."""
    return piece.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")


def check_tokenizer_type(tokenizer_type: str) -> str:
    """Validate a Megatron-LM ``--tokenizer-type`` value for a SentencePiece model file."""
    if tokenizer_type not in SENTENCEPIECE_TYPES:
        raise DataInputError(f"tokenizer_type: got {tokenizer_type!r}, supported {SENTENCEPIECE_TYPES}. "
                             "Fix: pass --tokenizer-type SentencePieceTokenizer with a .model file "
                             "(train one with tools/train_tokenizer.py).")
    return tokenizer_type


@dataclass(frozen=True, kw_only=True)
class TokenizerSpec:
    """Megatron-LM's tokenizer flags for a GPT dataset (``--tokenizer-type`` and the files it reads)."""

    tokenizer_type: str = "SentencePieceTokenizer"  # one of GPT_TOKENIZER_TYPES
    tokenizer_model: str | None = None  # SentencePiece/Llama2/TikToken file, or a HuggingFace tokenizer directory
    vocab_file: str | None = None  # GPT2BPETokenizer: vocab.json
    merge_file: str | None = None  # GPT2BPETokenizer: merges.txt
    # Megatron's --vocab-size: NullTokenizer's ids are below it; TikTokenizer's vocabulary, its special
    # tokens included (None: megatron-core's 131072)
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        t = self.tokenizer_type
        if t not in GPT_TOKENIZER_TYPES:
            raise DataInputError(f"tokenizer_type: got {t!r}; a GPT dataset takes one of {', '.join(GPT_TOKENIZER_TYPES)}."
                                 " Fix: pass one of those to --tokenizer-type")
        need = {"GPT2BPETokenizer": ("vocab_file", "merge_file"), "NullTokenizer": ("vocab_size",)}.get(
            t, ("tokenizer_model",))
        for name in need:
            if getattr(self, name) is None:
                # GPT2BPETokenizer would otherwise download GPT-2's files: nothing here fetches at run time
                raise DataInputError(f"{name}: --tokenizer-type {t} needs --{name.replace('_', '-')}. Fix: pass it"
                                     + (" (GPT-2's vocab.json and merges.txt, as Megatron-LM's preprocess_data.py "
                                        "took them)" if t == "GPT2BPETokenizer" else ""))
        for name in ("vocab_file", "merge_file") if t == "GPT2BPETokenizer" else ():
            require_file(Path(getattr(self, name)), field=name, fix=f"pass --{name.replace('_', '-')} with an "
                         "existing file")
        if t == "HuggingFaceTokenizer" and not Path(self.tokenizer_model).is_dir():
            raise DataInputError(f"tokenizer_model: {self.tokenizer_model!r} is not a directory. Fix: pass a local "
                                 "tokenizer directory (tokenizer.json, tokenizer_config.json); hub names are not "
                                 "fetched at run time: download once (huggingface-cli download NAME --local-dir DIR)"
                                 " and pass DIR")
        if t == "NullTokenizer" and self.vocab_size < 2:
            raise DataInputError(f"vocab_size: got {self.vocab_size}, the minimum is 2. Fix: pass --vocab-size")


def build_gpt_tokenizer(spec: TokenizerSpec) -> MegatronTokenizerBase:
    """megatron-core's tokenizer for ``spec``, as Megatron-LM builds it (``build_tokenizer``), the
    SentencePiece types through ``load_tokenizer`` (which checks the file first)."""
    if spec.tokenizer_type in SENTENCEPIECE_TYPES:
        return load_tokenizer(spec.tokenizer_model, tokenizer_type=spec.tokenizer_type)
    if spec.tokenizer_type == "GPT2BPETokenizer":
        spec = TokenizerSpec(tokenizer_type="HuggingFaceTokenizer",
                             tokenizer_model=str(gpt2_bpe_directory(Path(spec.vocab_file), Path(spec.merge_file))))
    import types

    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    if spec.tokenizer_type == "TikTokenizer":
        try:
            import tiktoken  # noqa: F401  (megatron-core imports it guarded and fails later with a NameError)
        except ImportError:
            raise DataInputError("tokenizer_type: TikTokenizer needs the tiktoken package, which is not installed. "
                                 "Fix: pip install tiktoken (or pip install 'megatron-het[tiktoken]')") from None

    # Megatron-LM's defaults for the tokenizer flags we do not take (runtime/flag_policy.py refuses them)
    args = types.SimpleNamespace(
        tokenizer_type=spec.tokenizer_type, tokenizer_model=spec.tokenizer_model, vocab_file=spec.vocab_file,
        merge_file=spec.merge_file, vocab_size=spec.vocab_size, special_tokens=None, chat_template=None,
        tokenizer_hf_no_use_fast=False, trust_remote_code=False, tokenizer_hf_no_include_special_tokens=False,
        tiktoken_pattern=None, tiktoken_num_special_tokens=1000, metadata_path=None, pad_vocab_size=False)
    try:
        return build_tokenizer(args)
    except (OSError, ValueError, KeyError, AssertionError) as err:  # a file of the wrong kind: one line naming it
        what = spec.tokenizer_model or spec.vocab_file
        fix = ("pass a tiktoken vocabulary JSON (a list of {rank, token_bytes, token_str}, the 256 single bytes "
               "first) and --vocab-size = its entries + 1000 special tokens (Megatron-LM's default 131072 fits "
               "the Llama-3/Nemotron files)" if spec.tokenizer_type == "TikTokenizer"
               else "pass the files that tokenizer type reads")
        raise DataInputError(f"tokenizer_model: --tokenizer-type {spec.tokenizer_type} could not load {what!r} "
                             f"({type(err).__name__}: {str(err)[:200]}). Fix: {fix}") from None


def check_sentencepiece_model(path: Path) -> int:
    """Refuse an empty or unreadable SentencePiece model file naming it; returns its piece count."""
    import sentencepiece as spm

    data = path.read_bytes()
    fix = "pass --tokenizer-model with the .model file written by tools/train_tokenizer.py (not the .vocab)"
    if not data:
        raise DataInputError(f"tokenizer_model: {str(path)!r} is empty. Fix: {fix}.")
    try:
        pieces = spm.SentencePieceProcessor(model_proto=data).get_piece_size()
    except (RuntimeError, OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataInputError(f"tokenizer_model: {str(path)!r} is not a SentencePiece model ({first}). "
                             f"Fix: {fix}.") from None
    if pieces < 4:
        raise DataInputError(f"tokenizer_model: {str(path)!r} has {pieces} pieces, too few for unk/bos/eos/pad. "
                             f"Fix: {fix}.")
    return pieces


def load_tokenizer(model_path: Path | str, *, tokenizer_type: str = "SentencePieceTokenizer") -> MegatronTokenizerBase:
    """megatron-core's GPT tokenizer over a SentencePiece model: ``tokenize``, ``detokenize``,
    ``eod``, ``pad``, ``vocab_size`` and ``unique_identifiers``, as ``GPTDatasetConfig`` needs."""
    check_tokenizer_type(tokenizer_type)
    path = require_file(Path(model_path), field="tokenizer_model",
                        fix="pass --tokenizer-model with an existing SentencePiece .model file "
                            "(train one with tools/train_tokenizer.py).")
    check_sentencepiece_model(path)
    from megatron.core.tokenizers import MegatronTokenizer

    # metadata as a dict: no tokenizer_metadata.json is written next to the model file.
    return MegatronTokenizer.from_pretrained(tokenizer_path=str(path.resolve()),
                                             metadata_path={"library": "sentencepiece", "model_type": "gpt"})


# GPT-2's tokenizer settings (the hub's gpt2 tokenizer_config.json): what megatron-core's
# GPT2BPETokenizer fetches from huggingface.co before it reads the vocab/merges files it was given
GPT2_TOKENIZER_CONFIG = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
                         "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "add_prefix_space": False,
                         "model_max_length": 1024}


def gpt2_bpe_directory(vocab_file: Path, merges_file: Path) -> Path:
    """A local HuggingFace tokenizer directory for GPT-2 BPE files: the two files and GPT-2's tokenizer
    settings. megatron-core's GPT2BPETokenizer asks the hub for those settings (network, retries);
    written here instead, so the same tokenizer loads offline. Named by the files' content, so every
    rank (and every run) uses one directory; written atomically (a temporary directory renamed)."""
    import hashlib
    import json
    import os
    import tempfile

    vocab, merges = vocab_file.read_bytes(), merges_file.read_bytes()
    config = json.dumps(GPT2_TOKENIZER_CONFIG, sort_keys=True).encode()
    files = {"vocab.json": vocab, "merges.txt": merges, "tokenizer_config.json": config}
    digest = hashlib.sha256(b"\0".join((vocab, merges, config))).hexdigest()[:20]
    target = Path(tempfile.gettempdir()) / f"megatron_het_gpt2bpe_{os.getuid()}_{digest}"
    def holds_files() -> bool:
        return target.is_dir() and all((target / n).is_file() and (target / n).read_bytes() == b
                                       for n, b in files.items())

    if holds_files():
        return target
    work = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    for name, data in files.items():
        (work / name).write_bytes(data)
    try:
        os.rename(work, target)  # another rank may have won: its copy holds the same bytes
    except OSError:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
        if not holds_files():
            raise DataInputError(f"vocab_file: {str(target)!r} exists with other contents. Fix: remove it") from None
    return target
