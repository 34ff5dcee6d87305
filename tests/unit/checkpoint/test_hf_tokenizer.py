"""The exported Hugging Face tokenizer, loaded by the real client (transformers' AutoTokenizer).

Reference: the SentencePiece processor of the same model file. The tokenizer is trained here on the
shipped corpus exactly as `make demo` trains it (tools/train_tokenizer.py defaults, vocab 512).
Everything is local (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_het.checkpoint.convert import ModelState, expected_shapes, read_hf, write_hf
from megatron_het.checkpoint.convert.errors import ConvertError
from megatron_het.checkpoint.convert.hf_tokenizer import FILES, check_tokenizer_model, write_hf_tokenizer
from megatron_het.checkpoint.convert.io import atomic_output_dir
from megatron_het.cli.convert import main as convert_main
from megatron_het.cluster import ModelSpec

from support.paths import EXAMPLES, REPO

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when huggingface_hub is imported: everything is local

CORPUS = EXAMPLES / "data" / "corpus.jsonl"
LLAMA = ModelSpec(num_layers=1, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
                  seq_length=8, vocab_size=512, swiglu=True, untie_embeddings_and_output_weights=True)
# What the text of a model's users looks like beyond the corpus: whitespace runs, newlines, tabs,
# leading/trailing spaces, non-ASCII, characters outside the vocabulary, special-token lookalikes.
EXTRA = ["", " ", "   ", "x", "  two  spaces  ", "\n\nnew\nlines\n\n", "\ttab\t\tand  \n  indent",
         " leading", "trailing ", "héllo wörld, ß and ç", "emoji 🙂 and 漢字 and \u200b zero width",
         "<s> </s> <unk> <pad> are text here", "<0x41> is text too", "12345 678.9", "a\r\nb", "\x00\x07"]
OUTSIDE_VOCAB = "🙂漢"  # each must be encoded as byte pieces


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    from megatron_het.data.tokenizer import TokenizerTrainConfig, train_tokenizer

    out = tmp_path_factory.mktemp("sp")
    return str(train_tokenizer(TokenizerTrainConfig(input=CORPUS, output_prefix=out / "sp")).model_path)


@pytest.fixture(scope="module")
def processor(sp_model):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=sp_model)


def auto_tokenizer(path):
    import transformers  # a test dependency (scripts/bootstrap_env.sh installs it): no skip

    return transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def exported(sp_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf-tokenizer")
    ids = write_hf_tokenizer(sp_model, str(out), vocab_size=512, max_length=1 << 20)
    return ids, auto_tokenizer(out)


def corpus_texts() -> list[str]:
    with open(CORPUS, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.mark.parametrize("which", ["corpus", "extra"])
def test_ids_and_round_trip_equal_sentencepiece(exported, processor, which):
    _, tok = exported
    texts = corpus_texts() if which == "corpus" else EXTRA
    assert len(texts) > (200 if which == "corpus" else 10)
    for text in texts:
        want = processor.encode(text)
        got = tok.encode(text, add_special_tokens=False)
        assert got == want, f"{text[:60]!r}: first difference at {next(i for i, (a, b) in enumerate(zip(got + [-1], want + [-1])) if a != b)}"
        assert tok.decode(got) == text, repr(text[:60])


def test_outside_the_vocabulary_falls_back_to_bytes(exported, processor):
    _, tok = exported
    for char in OUTSIDE_VOCAB:
        ids = tok.encode(char, add_special_tokens=False)
        byte_ids = [i for i in ids if processor.is_byte(i)]
        assert len(byte_ids) == len(char.encode("utf-8")), (char, ids)  # one piece per UTF-8 byte
        assert ids == processor.encode(char) and tok.decode(ids) == char


def test_special_ids_are_the_projects(exported):
    from megatron_het.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID

    ids, tok = exported
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (UNK_ID, BOS_ID, EOS_ID, PAD_ID)
    assert (ids.bos_token_id, ids.eos_token_id, ids.pad_token_id, ids.pieces) == (BOS_ID, EOS_ID, PAD_ID, 512)
    # No BOS/EOS added by default (the training data has none); skip_special_tokens drops the eod.
    plain = tok("some text").input_ids
    assert BOS_ID not in plain and EOS_ID not in plain
    assert tok.decode(plain + [EOS_ID], skip_special_tokens=True) == "some text"


def test_unexportable_tokenizers_are_refused(sp_model, tmp_path):
    from megatron_het.data.tokenizer import TokenizerTrainConfig, train_tokenizer

    with pytest.raises(ConvertError, match=r"512 pieces, more than the model's vocab_size 300"):
        write_hf_tokenizer(sp_model, str(tmp_path), vocab_size=300, max_length=8)
    assert os.listdir(tmp_path) == []  # refused before anything is written
    unigram = train_tokenizer(TokenizerTrainConfig(input=CORPUS, output_prefix=tmp_path / "uni", model_type="unigram"))
    with pytest.raises(ConvertError, match=r"model_type UNIGRAM \(only BPE encodes identically\).*--no-tokenizer"):
        check_tokenizer_model(str(unigram.model_path))
    assert check_tokenizer_model(str(unigram.model_path), export=False) == 512  # kept (not exported) in het
    with pytest.raises(ConvertError, match=r"uni.vocab: not a SentencePiece model"):
        check_tokenizer_model(str(unigram.vocab_path))
    with pytest.raises(ConvertError, match=r"missing.model: cannot read it \(No such file"):
        check_tokenizer_model(str(tmp_path / "missing.model"))


def hf_input(tmp_path, model: ModelSpec = LLAMA, tokenizer: str | None = None) -> str:
    g = torch.Generator().manual_seed(0)
    state = ModelState(model=model, tensors={n: torch.randn(s, generator=g) for n, s in expected_shapes(model).items()},
                       tokenizer_model=tokenizer)
    path = str(tmp_path / "in")
    with atomic_output_dir(path) as tmp:
        write_hf(state, tmp)
    return path


def convert(src: str, dst, *extra: str) -> int:
    return convert_main(["--input", src, "--input-format", "hf", "--output", str(dst), "--output-format", "hf",
                         "--no-progress", *extra])


def test_cli_writes_the_tokenizer_it_is_given(tmp_path, sp_model, processor, capsys):
    src = hf_input(tmp_path)
    assert convert(src, tmp_path / "out", "--tokenizer-model", sp_model) == 0
    out = tmp_path / "out"
    assert all((out / f).is_file() for f in FILES)
    assert (out / "tokenizer.model").read_bytes() == open(sp_model, "rb").read()
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 3)
    tok = auto_tokenizer(out)
    assert tok.model_max_length == LLAMA.max_position_embeddings
    assert tok("def f(x):\n    return x").input_ids == processor.encode("def f(x):\n    return x")
    assert f"tokenizer: {sp_model} written with the weights" in capsys.readouterr().err
    # An export that keeps a tokenizer passes it on with no flag (hf -> hf here; hf -> het in tests/multiproc).
    assert read_hf(str(out)).tokenizer_model == str(out / "tokenizer.model")
    assert convert(str(out), tmp_path / "again") == 0
    assert (tmp_path / "again" / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()
    assert convert(str(out), tmp_path / "bare", "--no-tokenizer") == 0
    assert not any((tmp_path / "bare" / f).exists() for f in FILES)


def test_cli_tokenizer_model_wins_over_the_inputs(tmp_path, sp_model):
    from megatron_het.data.tokenizer import TokenizerTrainConfig, train_tokenizer

    other = str(train_tokenizer(TokenizerTrainConfig(input=CORPUS, output_prefix=tmp_path / "other",
                                                     vocab_size=400)).model_path)
    src = hf_input(tmp_path, tokenizer=sp_model)  # keeps the 512-piece tokenizer
    assert convert(src, tmp_path / "out", "--tokenizer-model", other) == 0
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == open(other, "rb").read()
    assert len(auto_tokenizer(tmp_path / "out")) == 400


def test_save_checkpoint_refuses_a_missing_tokenizer_before_any_collective(tmp_path):
    from megatron_het.checkpoint.dist_ckpt import save_checkpoint
    from megatron_het.checkpoint.errors import CheckpointError

    # No process group is up: the file is read before the first collective, on every rank alike.
    with pytest.raises(CheckpointError, match=r"nope.model: cannot read the tokenizer model .*No such file"):
        save_checkpoint(str(tmp_path / "save"), 1, params={}, optimizer_state={}, common={},
                        tokenizer_model=str(tmp_path / "nope.model"))
    assert not (tmp_path / "save").exists()


def test_cli_without_a_tokenizer_says_so_in_one_line(tmp_path):
    import subprocess
    import sys

    src = hf_input(tmp_path)
    # The real command line in a fresh process (no megatron-core import on this path: ~2 s).
    done = subprocess.run([sys.executable, str(REPO / "tools" / "checkpoint" / "convert.py"), "--input", src, "--input-format", "hf",
                           "--output", str(tmp_path / "out"), "--output-format", "hf", "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()  # the summary, then the one line about the tokenizer
    assert len(lines) == 2 and lines[0].startswith("converted 9 tensors"), done.stderr
    assert "no tokenizer written" in lines[1] and "rerun with --tokenizer-model PATH" in lines[1], done.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_cli_refuses_a_tokenizer_larger_than_the_vocabulary(tmp_path, sp_model, capsys):
    small = ModelSpec(**{**LLAMA.__dict__, "vocab_size": 300})
    src = hf_input(tmp_path, small)
    assert convert(src, tmp_path / "out", "--tokenizer-model", sp_model) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "512 pieces, more than the model's vocab_size 300" in err[0], err
    assert not (tmp_path / "out").exists() and sorted(os.listdir(tmp_path)) == ["in"]  # nothing written
