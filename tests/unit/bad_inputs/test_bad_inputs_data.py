"""Bad inputs to the data tools (#21): preprocess_data.py, train_tokenizer.py, make_corpus.py."""

from __future__ import annotations

import json

import pytest
from bad_input_harness import CORPUS, DEEP_JSON, GARBAGE, Row, check_row

from megatron_het.cli import make_corpus, preprocess, tokenizer
from megatron_het.data.tokenizer import TokenizerTrainConfig, train_tokenizer


@pytest.fixture(scope="module")
def subs(tmp_path_factory) -> dict[str, str]:
    """A real SentencePiece model (outside the rows' working directories)."""
    root = tmp_path_factory.mktemp("sp")
    small = root / "small.jsonl"
    small.write_text("\n".join(open(CORPUS, encoding="utf-8").read().splitlines()[:60]) + "\n", encoding="utf-8")
    model = train_tokenizer(TokenizerTrainConfig(input=small, output_prefix=root / "sp", vocab_size=400)).model_path
    return {"sp": str(model)}


GOOD = '{"text": "hello world"}\n'
PRE = ("--json-keys", "text", "--tokenizer-model", "{sp}")

PREPROCESS_ROWS = [
    Row(id="input-missing", argv=("--input", "in.jsonl", "--output-prefix", "out", *PRE), names=("in.jsonl",)),
    Row(id="input-directory", argv=("--input", "indir", "--output-prefix", "out", *PRE), dirs=("indir",),
        names=("indir",)),
    Row(id="input-non-utf8", argv=("--input", "in.jsonl", "--output-prefix", "out", *PRE),
        files={"in.jsonl": GOOD.encode() + b'{"text": "caf\xe9"}\n'}, names=("in.jsonl",)),
    Row(id="input-garbage-line", argv=("--input", "in.jsonl", "--output-prefix", "out", *PRE),
        files={"in.jsonl": GOOD + "{not json\n"}, names=("in.jsonl",)),
    Row(id="input-deep-json", argv=("--input", "in.jsonl", "--output-prefix", "out", *PRE),
        files={"in.jsonl": GOOD + DEEP_JSON + "\n"}, names=("in.jsonl",)),
    Row(id="input-key-missing", argv=("--input", "in.jsonl", "--output-prefix", "out", *PRE),
        files={"in.jsonl": GOOD + json.dumps({"body": "no text key"}) + "\n"}, names=("in.jsonl", "text")),
    Row(id="input-value-not-string", argv=("--input", "in.jsonl", "--output-prefix", "out", *PRE),
        files={"in.jsonl": GOOD + json.dumps({"text": [1, 2]}) + "\n"}, names=("in.jsonl",)),
    Row(id="model-missing", argv=("--input", "in.jsonl", "--output-prefix", "out", "--tokenizer-model", "sp.model"),
        files={"in.jsonl": GOOD}, names=("sp.model",)),
    Row(id="model-empty", argv=("--input", "in.jsonl", "--output-prefix", "out", "--tokenizer-model", "sp.model"),
        files={"in.jsonl": GOOD, "sp.model": b""}, names=("sp.model",)),
    Row(id="model-garbage", argv=("--input", "in.jsonl", "--output-prefix", "out", "--tokenizer-model", "sp.model"),
        files={"in.jsonl": GOOD, "sp.model": GARBAGE}, names=("sp.model",)),
    Row(id="model-directory", argv=("--input", "in.jsonl", "--output-prefix", "out", "--tokenizer-model", "spdir"),
        files={"in.jsonl": GOOD}, dirs=("spdir",), names=("spdir",)),
    Row(id="output-under-file", argv=("--input", "in.jsonl", "--output-prefix", "f.txt/out", *PRE),
        files={"in.jsonl": GOOD, "f.txt": "x"}, names=("f.txt",)),
    Row(id="output-onto-directory", argv=("--input", "in.jsonl", "--output-prefix", "out", *PRE),
        files={"in.jsonl": GOOD}, dirs=("out_text_document.bin",), names=("out_text_document.bin",)),
    Row(id="workers-zero", argv=("--input", "in.jsonl", "--output-prefix", "out", *PRE, "--workers", "0"),
        files={"in.jsonl": GOOD}, names=("workers",)),
    Row(id="workers-not-int", argv=("--input", "in.jsonl", "--output-prefix", "out", *PRE, "--workers", "two"),
        files={"in.jsonl": GOOD}, names=("--workers",)),
    Row(id="tokenizer-type-typo", argv=("--input", "in.jsonl", "--output-prefix", "out", *PRE,
                                        "--tokenizer-type", "SentencePeiceTokenizer"),
        files={"in.jsonl": GOOD}, names=("tokenizer_type", "--tokenizer-type", "SentencePeiceTokenizer")),
    Row(id="missing-required", argv=("--input", "in.jsonl", *PRE), files={"in.jsonl": GOOD},
        names=("--output-prefix",)),    # a new-user review: the directories on the way to a new --output-prefix were left behind on failure
    Row(id="new-dirs-input-key-missing", argv=("--input", "in.jsonl", "--output-prefix", "nodir/sub/corpus", *PRE),
        files={"in.jsonl": GOOD + json.dumps({"body": "no text key"}) + "\n"}, names=("in.jsonl", "text")),
    Row(id="new-dirs-input-garbage-line", argv=("--input", "in.jsonl", "--output-prefix", "data/nodir/sub/corpus",
                                                *PRE),
        dirs=("data",), files={"in.jsonl": GOOD + "{not json\n"}, names=("in.jsonl",)),
]

TOKENIZER_ROWS = [
    Row(id="input-missing", argv=("--input", "in.jsonl", "--output-prefix", "sp"), names=("in.jsonl",)),
    Row(id="input-non-utf8", argv=("--input", "in.jsonl", "--output-prefix", "sp"),
        files={"in.jsonl": GOOD.encode() + b'{"text": "\xff\xfe"}\n'}, names=("in.jsonl",)),
    Row(id="vocab-not-int", argv=("--input", CORPUS, "--output-prefix", "sp", "--vocab-size", "big"),
        names=("--vocab-size",)),
    Row(id="vocab-zero", argv=("--input", CORPUS, "--output-prefix", "sp", "--vocab-size", "0"),
        names=("vocab_size", "--vocab-size")),
    Row(id="vocab-huge", argv=("--input", CORPUS, "--output-prefix", "sp", "--vocab-size", str(10**12)),
        names=("vocab_size", "--vocab-size")),
    Row(id="model-type-typo", argv=("--input", CORPUS, "--output-prefix", "sp", "--model-type", "bep"),
        names=("--model-type",)),
    # (a missing parent is created, like mkdir -p: the data tools' documented behaviour)
    Row(id="output-under-file", argv=("--input", CORPUS, "--output-prefix", "f.txt/sp"), files={"f.txt": "x"},
        names=("f.txt",)),
    Row(id="output-onto-directory", argv=("--input", CORPUS, "--output-prefix", "sp"), dirs=("sp.model",),
        names=("sp.model",)),    Row(id="new-dirs-input-non-utf8", argv=("--input", "in.jsonl", "--output-prefix", "nodir/sub/sp"),
        files={"in.jsonl": GOOD.encode() + b'{"text": "\xff\xfe"}\n'}, names=("in.jsonl",)),
]

CORPUS_ROWS = [
    Row(id="max-bytes-not-int", argv=("--output", "c.jsonl", "--max-bytes", "lots"), names=("--max-bytes",)),
    Row(id="output-directory", argv=("--output", "cdir"), dirs=("cdir",), names=("cdir",)),
    Row(id="stdlib-dir-missing", argv=("--output", "c.jsonl", "--stdlib-dir", "nolib"), names=("nolib",)),
]


@pytest.mark.parametrize("row", PREPROCESS_ROWS, ids=lambda r: r.id)
def test_preprocess_refuses(row, subs, tmp_path, capsys, monkeypatch):
    check_row(preprocess.main, row, tmp_path, capsys, monkeypatch, subs=subs)


@pytest.mark.parametrize("row", TOKENIZER_ROWS, ids=lambda r: r.id)
def test_train_tokenizer_refuses(row, tmp_path, capsys, monkeypatch):
    check_row(tokenizer.main, row, tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("row", CORPUS_ROWS, ids=lambda r: r.id)
def test_make_corpus_refuses(row, tmp_path, capsys, monkeypatch):
    check_row(make_corpus.main, row, tmp_path, capsys, monkeypatch)
