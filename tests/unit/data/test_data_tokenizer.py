"""SentencePiece training and loading: exact round trips, fixed special ids, determinism, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.paths import GOLDEN, REPO, TESTS
from megatron_het.data.corpus import CorpusConfig, default_stdlib_dir, module_document, stdlib_documents
from megatron_het.data.jsonl import DataInputError
from megatron_het.data.tokenizer import TokenizerTrainConfig, load_tokenizer, train_tokenizer

CORPUS = REPO / "examples" / "data" / "corpus.jsonl"
# Whitespace runs, tabs, newlines and characters outside the training corpus must survive.
TRICKY = ["  leading spaces\n\tand a tab", "trailing spaces   \n\n", "caf\u00e9 \u2713 \u65e5\u672c 12345", "x"]


def corpus_texts(n: int) -> list[str]:
    with CORPUS.open(encoding="utf-8") as lines:
        return [json.loads(line)["text"] for line, _ in zip(lines, range(n))]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts(60)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory):
    prefix = tmp_path_factory.mktemp("tok") / "sp512"
    return train_tokenizer(TokenizerTrainConfig(input=small_corpus, output_prefix=prefix, vocab_size=512))


def test_shipped_corpus_size_and_shape() -> None:
    size = CORPUS.stat().st_size
    assert 500_000 <= size <= 1_500_000, size
    texts = corpus_texts(10_000)
    assert len(texts) == 239
    assert texts[0].startswith("Module __future__.")
    assert all(len(t) >= 200 for t in texts)


def test_module_document_collects_docstrings_in_order() -> None:
    source = '"""Top."""\nclass A:\n    """About A."""\n    def f(self):\n        """About f."""\n'
    assert module_document(source, "pkg.mod") == "Module pkg.mod.\n\nTop.\n\nThe class A: About A.\n\nThe function f: About f."
    assert module_document("def broken(:\n", "x") == ""


def test_stdlib_documents_respect_max_bytes() -> None:
    docs = stdlib_documents(CorpusConfig(stdlib_dir=default_stdlib_dir(), max_bytes=20_000))
    size = sum(len(json.dumps({"text": d}).encode()) + 1 for d in docs)
    assert 0 < size <= 20_000
    with pytest.raises(ValueError, match=r"max_bytes: got 10, the minimum is 1000"):
        CorpusConfig(stdlib_dir=default_stdlib_dir(), max_bytes=10)


def test_trained_model_has_requested_vocab_and_fixed_special_ids(trained) -> None:
    assert trained.vocab_size == 512
    assert trained.num_documents == 60
    assert trained.model_path.name == "sp512.model" and trained.model_path.is_file()
    pieces = trained.vocab_path.read_text(encoding="utf-8").splitlines()
    assert len(pieces) == 512
    assert [p.split("\t")[0] for p in pieces[:4]] == ["<unk>", "<s>", "</s>", "<pad>"]
    tokenizer = load_tokenizer(trained.model_path)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad) == (512, 2, 3)


def test_round_trip_is_exact(trained) -> None:
    tokenizer = load_tokenizer(trained.model_path)
    for text in corpus_texts(60) + TRICKY:
        ids = tokenizer.tokenize(text)
        assert all(0 <= i < 512 for i in ids)
        assert tokenizer.detokenize(ids) == text
    # a learned vocabulary compresses English well below one token per character
    text = corpus_texts(1)[0]
    assert len(tokenizer.tokenize(text)) < 0.7 * len(text)


def test_training_is_deterministic(small_corpus: Path, trained, tmp_path: Path) -> None:
    again = train_tokenizer(TokenizerTrainConfig(input=small_corpus, output_prefix=tmp_path / "again"))
    assert again.model_path.read_bytes() == trained.model_path.read_bytes()


def test_unigram_also_trains(tmp_path: Path) -> None:
    corpus = tmp_path / "ten.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts(10)), encoding="utf-8")
    report = train_tokenizer(TokenizerTrainConfig(input=corpus, output_prefix=tmp_path / "uni",
                                                  model_type="unigram", vocab_size=400))
    tokenizer = load_tokenizer(report.model_path)
    assert tokenizer.vocab_size == 400
    assert tokenizer.detokenize(tokenizer.tokenize(TRICKY[0])) == TRICKY[0]


def test_config_errors_name_field_value_and_limit(small_corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"vocab_size: got 100, allowed 261\.\.65500.*Fix: pass --vocab-size"):
        TokenizerTrainConfig(input=small_corpus, output_prefix=tmp_path / "x", vocab_size=100)
    with pytest.raises(ValueError, match=r"model_type: got 'wordpiece'.*Fix"):
        TokenizerTrainConfig(input=small_corpus, output_prefix=tmp_path / "x", model_type="wordpiece")


def test_vocab_too_large_for_corpus_is_a_value_error(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text(json.dumps({"text": "a tiny corpus"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"vocab_size: SentencePiece could not train 5000 pieces on 1 documents"):
        train_tokenizer(TokenizerTrainConfig(input=tiny, output_prefix=tmp_path / "t", vocab_size=5000))


def test_input_errors(tmp_path: Path) -> None:
    with pytest.raises(DataInputError, match=r"input: '.*nope.jsonl' does not exist"):
        train_tokenizer(TokenizerTrainConfig(input=tmp_path / "nope.jsonl", output_prefix=tmp_path / "t"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"body": "no text key"}\n', encoding="utf-8")
    with pytest.raises(DataInputError, match=r"bad.jsonl:3: json key 'text' is missing \(keys on this line: \['body'\]\)"):
        train_tokenizer(TokenizerTrainConfig(input=bad, output_prefix=tmp_path / "t"))


def test_load_errors(tmp_path: Path, trained) -> None:
    with pytest.raises(DataInputError, match=r"tokenizer_model: '.*missing.model' does not exist.*train_tokenizer.py"):
        load_tokenizer(tmp_path / "missing.model")
    with pytest.raises(DataInputError, match=r"tokenizer_type: got 'GPT2BPETokenizer'"):
        load_tokenizer(trained.model_path, tokenizer_type="GPT2BPETokenizer")


def test_cli_trains_and_reports_errors(small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_tokenizer_tool", REPO / "tools" / "train_tokenizer.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--input", str(small_corpus), "--json-key", "text", "--vocab-size", "400",
                      "--output-prefix", str(tmp_path / "cli")]) == 0
    assert "400 pieces from 60 documents" in capsys.readouterr().out
    assert (tmp_path / "cli.model").is_file()
    assert tool.main(["--input", str(small_corpus), "--vocab-size", "7", "--output-prefix", str(tmp_path / "c")]) == 2
    assert "vocab_size: got 7" in capsys.readouterr().err
