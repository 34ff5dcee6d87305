"""A failed or killed preprocessing run never destroys the dataset it would replace (#21 item 3),
and bad inputs to the data tools end in one line naming the file, exit code 2, nothing written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_het.data.jsonl import DataInputError
from megatron_het.data.preprocess import PreprocessConfig, preprocess
from megatron_het.data.tokenizer import TokenizerTrainConfig, train_tokenizer

from support.paths import REPO

CORPUS = REPO / "examples" / "data" / "corpus.jsonl"


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """A tokenizer and an existing dataset (the "old pair") to protect."""
    root = tmp_path_factory.mktemp("atomic")
    lines = CORPUS.read_text(encoding="utf-8").splitlines()[:60]
    small = root / "small.jsonl"
    small.write_text("\n".join(lines) + "\n", encoding="utf-8")
    model = train_tokenizer(TokenizerTrainConfig(input=small, output_prefix=root / "sp", vocab_size=400)).model_path
    preprocess(PreprocessConfig(input=small, output_prefix=str(root / "ds"), tokenizer_model=model, append_eod=True))
    old = {ext: (root / f"ds_text_document{ext}").read_bytes() for ext in (".bin", ".idx")}
    return {"root": root, "model": model, "old": old, "lines": lines}


def _assert_old_pair_intact(setup) -> None:
    root = setup["root"]
    for ext, data in setup["old"].items():
        assert (root / f"ds_text_document{ext}").read_bytes() == data, ext
    leftovers = [p.name for p in root.iterdir() if p.name.startswith("ds_") and p.suffix not in (".bin", ".idx")]
    return leftovers


_CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import megatron_het.platform  # noqa: F401
    from megatron.core.datasets import indexed_dataset
    from megatron_het.data.preprocess import PreprocessConfig, preprocess

    src, prefix, model, ready = sys.argv[1:]
    add = indexed_dataset.IndexedDatasetBuilder.add_document
    count = [0]

    def slow_add(self, *args, **kwargs):  # stop mid-write, with documents already written
        add(self, *args, **kwargs)
        count[0] += 1
        if count[0] == 100:
            self.data_file.flush()
            Path(ready).write_text("writing")
            time.sleep(600)

    indexed_dataset.IndexedDatasetBuilder.add_document = slow_add
    preprocess(PreprocessConfig(input=Path(src), output_prefix=prefix, tokenizer_model=Path(model), append_eod=True))
""")


def test_sigkill_mid_write_leaves_old_dataset_intact(setup, tmp_path):
    root = setup["root"]
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(setup["lines"] * 5) + "\n", encoding="utf-8")  # 300 documents: a new dataset
    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(big), str(root / "ds"), str(setup["model"]),
                              str(ready)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None, child.stderr.read()
            assert time.monotonic() < deadline, "child never reached the write"
            time.sleep(0.1)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    leftovers = _assert_old_pair_intact(setup)  # byte-identical old .bin and .idx
    assert leftovers == ["ds_text_document.bin.tmp"]  # the killed run's partial file, under its own name


def test_error_mid_write_leaves_old_dataset_and_no_temp(setup, tmp_path):
    root = setup["root"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(setup["lines"] * 2) + '\n{"text": 5}\n', encoding="utf-8")
    (root / "ds_text_document.bin.tmp").unlink(missing_ok=True)
    with pytest.raises(DataInputError, match=r"bad.jsonl:121: json key 'text' holds a int"):
        preprocess(PreprocessConfig(input=bad, output_prefix=str(root / "ds"), tokenizer_model=setup["model"]))
    assert _assert_old_pair_intact(setup) == []


def test_success_replaces_the_pair(setup, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out = tmp_path / "new"
    src = tmp_path / "two.jsonl"
    src.write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n", encoding="utf-8")
    for _ in range(2):  # the second run replaces the first one's pair
        preprocess(PreprocessConfig(input=src, output_prefix=str(out), tokenizer_model=setup["model"]))
    assert len(IndexedDataset(str(tmp_path / "new_text_document"))) == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("new")) == [
        "new_text_document.bin", "new_text_document.idx"]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_inputs_are_one_line_exit_2_nothing_written(setup, tmp_path, capsys):
    from megatron_het.cli import make_corpus
    from megatron_het.cli import preprocess as preprocess_cli
    from megatron_het.cli import tokenizer as tokenizer_cli

    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    empty_model = tmp_path / "empty.model"
    empty_model.write_bytes(b"")
    bad_model = tmp_path / "bad.model"
    bad_model.write_bytes(b"not a sentencepiece model")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    a_dir = tmp_path / "a_dir.jsonl"
    a_dir.mkdir()
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100000 + "]" * 100000 + "\n")
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "hello"}\n')
    pre = ["--no-progress", "--json-keys", "text"]
    cases = [
        (preprocess_cli, pre + ["--input", str(latin1), "--output-prefix", str(tmp_path / "o1"),
                                "--tokenizer-model", str(setup["model"])], "latin1.jsonl:2: not UTF-8"),
        (preprocess_cli, pre + ["--input", str(deep), "--output-prefix", str(tmp_path / "o2"),
                                "--tokenizer-model", str(setup["model"])], "deep.jsonl:1: JSON nested too deeply"),
        (preprocess_cli, pre + ["--input", str(good), "--output-prefix", str(tmp_path / "o3"),
                                "--tokenizer-model", str(empty_model)], "empty.model' is empty"),
        (preprocess_cli, pre + ["--input", str(good), "--output-prefix", str(tmp_path / "o4"),
                                "--tokenizer-model", str(bad_model)], "bad.model' is not a SentencePiece model"),
        (preprocess_cli, pre + ["--input", str(good), "--output-prefix", str(a_file / "o5"),
                                "--tokenizer-model", str(setup["model"])], "a_file' is a file, not a directory"),
        (tokenizer_cli, ["--input", str(latin1), "--output-prefix", str(tmp_path / "t1")], "latin1.jsonl:2: not UTF-8"),
        (tokenizer_cli, ["--input", str(good), "--output-prefix", str(a_file / "t2")], "is a file, not a directory"),
        (make_corpus, ["--output", str(a_dir), "--max-bytes", "2000"], "a_dir.jsonl' is a directory"),
        (make_corpus, ["--output", str(a_file / "c.jsonl"), "--max-bytes", "2000"], "is a file, not a directory"),
    ]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for tool, argv, expected in cases:
        assert tool.main(argv) == 2, (tool.__name__, argv)
        line = _one_line_error(capsys)
        assert expected in line and "Fix:" in line, line
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written
