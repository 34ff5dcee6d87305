"""The run's SentencePiece model as a Hugging Face tokenizer (``AutoTokenizer.from_pretrained`` loads it).

Written files: ``tokenizer.json`` (a ``tokenizers`` BPE built from the SentencePiece pieces),
``tokenizer_config.json`` / ``special_tokens_map.json`` (the project's special pieces) and the
original ``tokenizer.model`` (for sentencepiece users, and read back when converting to het).

Mapping (BPE models of tools/train_tokenizer.py: identity normalization, whitespace kept, byte
fallback, dummy prefix): the normalizer prepends ``▁`` and turns spaces into ``▁`` as SentencePiece
does; the merges are every split of a normal piece into two pieces, ranked by the piece's score
(SentencePiece merges the highest-scored piece first); characters outside the vocabulary fall back
to ``<0xNN>`` byte pieces; the decoder undoes it all and drops the dummy prefix. Unigram models are
refused: SentencePiece and ``tokenizers`` break ties between equal-score segmentations differently
(measured: 8 of the 239 corpus documents get other ids for whitespace runs).
No BOS/EOS is added: the project's data pipeline adds none (``--append-eod`` appends EOS per document).
Encoding equality with SentencePiece is tested on the shipped corpus (tests/unit/checkpoint).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from megatron_het.checkpoint.convert.errors import ConvertError
from megatron_het.utils.atomic import write_bytes_atomic, write_text_atomic

TOKENIZER_MODEL = "tokenizer.model"  # the SentencePiece model, as HF Llama repositories name it
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", TOKENIZER_MODEL)
SPACE = "\u2581"  # SentencePiece's whitespace symbol
_FIX_MODEL = "pass --tokenizer-model with the SentencePiece .model file the run trained with (not the .vocab)"


@dataclass(frozen=True, kw_only=True)
class SpecialIds:
    """The tokenizer's special piece ids (-1: the model has none), for the model's config.json."""

    bos_token_id: int  # SentencePiece bos_id (1 for tools/train_tokenizer.py)
    eos_token_id: int  # eos_id: the end-of-document token --append-eod writes (2)
    pad_token_id: int  # pad_id (3)
    pieces: int  # number of pieces (ids 0..pieces-1)


def _load(path: str):
    """(processor, model proto, file bytes) of the SentencePiece file ``path``; errors name the file and the fix."""
    import sentencepiece as spm

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConvertError(f"tokenizer model {path}: cannot read it ({e.strerror}). Fix: {_FIX_MODEL}") from None
    try:
        if not data:
            raise RuntimeError("empty file")
        sp = spm.SentencePieceProcessor(model_proto=data)
    except (RuntimeError, OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConvertError(f"tokenizer model {path}: not a SentencePiece model ({first}). Fix: {_FIX_MODEL}") from None
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError:
        raise ConvertError(f"tokenizer model {path}: reading a SentencePiece model's settings needs the protobuf "
                           f"package. Fix: pip install protobuf") from None
    proto = pb.ModelProto()
    proto.ParseFromString(data)
    return sp, proto, data


def _check(sp, proto, path: str, *, vocab_size: int | None, export: bool) -> None:
    """Refuse more pieces than the model has rows and, to ``export``, settings this mapping does not
    reproduce."""
    pieces = sp.get_piece_size()
    if vocab_size is not None and pieces > vocab_size:
        raise ConvertError(f"tokenizer model {path}: {pieces} pieces, more than the model's vocab_size "
                           f"{vocab_size}. Fix: {_FIX_MODEL}")
    if not export:
        return
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    problems = []
    if trainer.model_type != trainer.BPE:
        problems.append(f"model_type {trainer.ModelType.Name(trainer.model_type)} (only BPE encodes identically)")
    if norm.name not in ("identity", "") or norm.precompiled_charsmap:
        problems.append(f"normalization {norm.name!r} (only 'identity' is reproduced)")
    if norm.remove_extra_whitespaces:
        problems.append("remove_extra_whitespaces=true")
    if not norm.escape_whitespaces:
        problems.append("escape_whitespaces=false")
    if trainer.treat_whitespace_as_suffix:
        problems.append("treat_whitespace_as_suffix=true")
    if problems:
        raise ConvertError(f"tokenizer model {path}: SentencePiece settings {'; '.join(problems)} cannot be "
                           f"exported as a Hugging Face tokenizer. Fix: pass --tokenizer-model with a BPE model "
                           f"trained by tools/train_tokenizer.py (--model-type bpe), or --no-tokenizer to export "
                           f"the weights alone")


def _bpe(sp, vocab: dict[str, int]) -> dict:
    ranked = []
    for i in range(sp.get_piece_size()):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i):
            continue
        piece = sp.id_to_piece(i)
        for cut in range(1, len(piece)):  # every way the piece splits into two pieces
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-sp.get_score(i), i, vocab[left], vocab[right], left, right))
    ranked.sort()  # SentencePiece merges the highest-scored piece first, then the leftmost pair
    return {"type": "BPE", "dropout": None, "unk_token": sp.id_to_piece(sp.unk_id()),
            "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
            "byte_fallback": True, "ignore_merges": False, "vocab": vocab,
            "merges": [[left, right] for *_, left, right in ranked]}


def tokenizer_json(sp, proto) -> dict:
    """The ``tokenizers`` JSON of a SentencePiece processor and its model proto (pure)."""
    n = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    dummy = proto.normalizer_spec.add_dummy_prefix
    normalizers = [{"type": "Prepend", "prepend": SPACE}] if dummy else []
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": SPACE})
    decoders = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]
    if dummy:  # after Fuse there is one string: strip the one dummy space at its start
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    specials = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": sp.id_to_piece(i), "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True} for i in specials],
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": _bpe(sp, vocab),
    }


def _piece(sp, token_id: int) -> str | None:
    return sp.id_to_piece(token_id) if 0 <= token_id < sp.get_piece_size() else None


def check_tokenizer_model(path: str, *, vocab_size: int | None = None, export: bool = True) -> int:
    """Refuse a file that is not a SentencePiece model, one with more pieces than the model's
    (unpadded) ``vocab_size`` rows and, with ``export``, one this module cannot write as a Hugging
    Face tokenizer; returns its number of pieces."""
    sp, proto, _ = _load(path)
    _check(sp, proto, path, vocab_size=vocab_size, export=export)
    return sp.get_piece_size()


def write_hf_tokenizer(path: str, out_dir: str, *, vocab_size: int, max_length: int) -> SpecialIds:
    """Write the tokenizer files (``FILES``) of SentencePiece model ``path`` into ``out_dir``.

    ``vocab_size`` is the model's (unpadded) vocabulary: every piece id must be a row of it;
    ``max_length`` (the model's positions) becomes ``model_max_length``.
    """
    sp, proto, data = _load(path)
    _check(sp, proto, path, vocab_size=vocab_size, export=True)
    specials = {"bos_token": _piece(sp, sp.bos_id()), "eos_token": _piece(sp, sp.eos_id()),
                "unk_token": _piece(sp, sp.unk_id()), "pad_token": _piece(sp, sp.pad_id())}
    specials = {k: v for k, v in specials.items() if v is not None}
    # split_special_tokens: "<s>" typed in text is text, as SentencePiece encodes it.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "split_special_tokens": True, **specials}
    write_text_atomic(os.path.join(out_dir, "tokenizer.json"), json.dumps(tokenizer_json(sp, proto), ensure_ascii=False))
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", specials)):
        write_text_atomic(os.path.join(out_dir, name), json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    write_bytes_atomic(os.path.join(out_dir, TOKENIZER_MODEL), data)
    return SpecialIds(bos_token_id=sp.bos_id(), eos_token_id=sp.eos_id(), pad_token_id=sp.pad_id(),
                      pieces=sp.get_piece_size())
