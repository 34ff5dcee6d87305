"""JSONL -> .bin/.idx: documents decode back to the input texts; Megatron-LM naming; errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy
import pytest

import megatron_het.platform  # noqa: F401  (triton import guard before megatron.core)

from support.paths import GOLDEN, REPO, TESTS
from megatron_het.data.jsonl import DataInputError
from megatron_het.data.preprocess import PreprocessConfig, preprocess
from megatron_het.data.tokenizer import TokenizerTrainConfig, load_tokenizer, train_tokenizer

CORPUS = REPO / "examples" / "data" / "corpus.jsonl"


def corpus_texts(n: int) -> list[str]:
    with CORPUS.open(encoding="utf-8") as lines:
        return [json.loads(line)["text"] for line, _ in zip(lines, range(n))]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pre")


@pytest.fixture(scope="module")
def texts() -> list[str]:
    # real documents, plus whitespace and non-ASCII text the tokenizer never saw
    return corpus_texts(40) + ["  indented\n\tline\n", "na\u00efve \u2713"]


@pytest.fixture(scope="module")
def model(workdir: Path, texts: list[str]) -> Path:
    corpus = write_jsonl(workdir / "train.jsonl", [{"text": t} for t in texts])
    return train_tokenizer(TokenizerTrainConfig(input=corpus, output_prefix=workdir / "sp", vocab_size=512)).model_path


def config(**overrides) -> PreprocessConfig:
    return PreprocessConfig(**overrides)


def test_documents_decode_back_to_inputs(workdir: Path, texts: list[str], model: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    src = write_jsonl(workdir / "in.jsonl", [{"text": t, "id": i} for i, t in enumerate(texts)])
    report = preprocess(config(input=src, output_prefix=str(workdir / "out"), tokenizer_model=model, append_eod=True))
    prefix = str(workdir / "out_text_document")
    assert report.prefixes == {"text": prefix}
    assert report.documents == len(texts) and report.skipped_empty == 0
    dataset = IndexedDataset(prefix)
    assert len(dataset) == len(texts)
    assert dataset.sequence_lengths.sum() == report.tokens["text"]
    assert list(dataset.document_indices) == list(range(len(texts) + 1))  # one sequence per document
    tokenizer = load_tokenizer(model)
    for i, text in enumerate(texts):
        doc = dataset[i]
        assert doc.dtype == numpy.uint16  # Megatron-LM's choice below 65500 pieces
        assert doc[-1] == tokenizer.eod == 2
        assert tokenizer.detokenize(doc[:-1].tolist()) == text


def test_without_append_eod_and_several_keys(workdir: Path, model: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    src = write_jsonl(workdir / "two.jsonl", [{"text": "hello world", "title": "Greeting"},
                                             {"text": "second", "title": "Other"}])
    report = preprocess(config(input=src, json_keys=("text", "title"), output_prefix=str(workdir / "k"),
                               tokenizer_model=model))
    tokenizer = load_tokenizer(model)
    titles = IndexedDataset(report.prefixes["title"])
    assert report.prefixes["title"].endswith("k_title_document")
    assert tokenizer.detokenize(titles[1].tolist()) == "Other"
    assert 2 not in titles[0].tolist()  # no eod without --append-eod
    assert report.tokens["text"] == len(tokenizer.tokenize("hello world")) + len(tokenizer.tokenize("second"))


def test_two_workers_write_identical_files(workdir: Path, texts: list[str], model: Path) -> None:
    src = write_jsonl(workdir / "many.jsonl", [{"text": t} for t in texts * 3])  # 126 docs: two chunks
    one = preprocess(config(input=src, output_prefix=str(workdir / "w1"), tokenizer_model=model, append_eod=True))
    two = preprocess(config(input=src, output_prefix=str(workdir / "w2"), tokenizer_model=model, append_eod=True,
                            workers=2))
    assert one.documents == two.documents == 126
    for suffix in (".bin", ".idx"):
        assert Path(one.prefixes["text"] + suffix).read_bytes() == Path(two.prefixes["text"] + suffix).read_bytes()


def test_empty_texts_are_skipped(workdir: Path, model: Path) -> None:
    src = write_jsonl(workdir / "empty.jsonl", [{"text": "a"}, {"text": ""}, {"text": "b"}])
    report = preprocess(config(input=src, output_prefix=str(workdir / "e"), tokenizer_model=model))
    assert (report.documents, report.skipped_empty) == (2, 1)


def test_progress_counts_documents_per_chunk(workdir: Path, model: Path) -> None:
    src = write_jsonl(workdir / "many.jsonl", [{"text": f"doc {i}"} for i in range(150)] + [{"text": ""}])
    calls: list[tuple[int, int]] = []
    report = preprocess(config(input=src, output_prefix=str(workdir / "m"), tokenizer_model=model),
                        progress=lambda done, total: calls.append((done, total)))
    assert report.documents == 150
    assert calls == [(64, 151), (128, 151), (151, 151)]  # CHUNK_DOCUMENTS = 64, the empty one included


def test_missing_input(workdir: Path, model: Path) -> None:
    with pytest.raises(DataInputError, match=r"input: '.*absent.jsonl' does not exist\. Fix: pass --input"):
        preprocess(config(input=workdir / "absent.jsonl", output_prefix=str(workdir / "x"), tokenizer_model=model))
    assert not (workdir / "x_text_document.bin").exists()


def test_missing_key_names_line_and_leaves_no_partial_output(workdir: Path, model: Path) -> None:
    src = write_jsonl(workdir / "nokey.jsonl", [{"text": "fine"}] * 70 + [{"content": "wrong key"}])
    with pytest.raises(DataInputError, match=r"nokey.jsonl:71: json key 'text' is missing \(keys on this line: "
                                             r"\['content'\]\)\. Fix: pass --json-keys"):
        preprocess(config(input=src, output_prefix=str(workdir / "nk"), tokenizer_model=model))
    assert not (workdir / "nk_text_document.bin").exists()
    assert not (workdir / "nk_text_document.idx").exists()


def test_bad_json_and_non_string(workdir: Path, model: Path) -> None:
    bad = workdir / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": \n', encoding="utf-8")
    with pytest.raises(DataInputError, match=r"bad.jsonl:2: not valid JSON"):
        preprocess(config(input=bad, output_prefix=str(workdir / "b"), tokenizer_model=model))
    num = write_jsonl(workdir / "num.jsonl", [{"text": 5}])
    with pytest.raises(DataInputError, match=r"num.jsonl:1: json key 'text' holds a int, not a string"):
        preprocess(config(input=num, output_prefix=str(workdir / "b"), tokenizer_model=model))


def test_missing_tokenizer_model_and_bad_type(workdir: Path, model: Path) -> None:
    src = write_jsonl(workdir / "ok.jsonl", [{"text": "fine"}])
    with pytest.raises(DataInputError, match=r"tokenizer_model: '.*no.model' does not exist"):
        preprocess(config(input=src, output_prefix=str(workdir / "t"), tokenizer_model=workdir / "no.model"))
    with pytest.raises(DataInputError, match=r"tokenizer_type: got 'BertWordPieceCase'; a GPT dataset takes one of"):
        config(input=src, output_prefix="t", tokenizer_model=model, tokenizer_type="BertWordPieceCase")
    with pytest.raises(DataInputError, match=r"tokenizer_model: '.*sp.model' is not a directory"):
        config(input=src, output_prefix="t", tokenizer_model=model, tokenizer_type="HuggingFaceTokenizer")
    with pytest.raises(ValueError, match=r"workers: got 0, the minimum is 1"):
        config(input=src, output_prefix="t", tokenizer_model=model, workers=0)


def test_cli_flags_match_megatron_lm(workdir: Path, model: Path, capsys: pytest.CaptureFixture) -> None:
    spec = importlib.util.spec_from_file_location("preprocess_tool", REPO / "tools" / "preprocess_data.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    src = write_jsonl(workdir / "cli.jsonl", [{"text": "one"}, {"text": "two"}])
    argv = ["--input", str(src), "--json-keys", "text", "--output-prefix", str(workdir / "cli"),
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(model), "--append-eod",
            "--workers", "1"]
    assert tool.main(argv) == 0
    out = capsys.readouterr()
    assert "text: 2 documents" in out.out
    assert out.err.splitlines()[-1].startswith("preprocess: 2/2 documents (100.0%)")  # progress on stderr
    assert tool.main(argv + ["--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    assert (workdir / "cli_text_document.idx").is_file()
    argv[argv.index("--tokenizer-model") + 1] = str(workdir / "gone.model")
    assert tool.main(argv) == 2
    assert "tokenizer_model: " in capsys.readouterr().err
