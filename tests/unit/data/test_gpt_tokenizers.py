"""Every tokenizer type of Megatron-LM's GPT path (#35 item 4): data tokenized with GPT-2 BPE files,
a HuggingFace tokenizer directory, a SentencePiece/Llama-2 model or pre-tokenized ids (NullTokenizer)
is read through megatron-core's tokenizers into the same GPT samples, offline."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megatron_het.data import GptDataConfig, build_gpt_datasets
from megatron_het.data.jsonl import DataInputError
from megatron_het.data.preprocess import PreprocessConfig, preprocess
from megatron_het.data.tokenizer import TokenizerSpec, build_gpt_tokenizer, gpt2_bpe_directory
from megatron_het.runtime.arguments import parse_args

from support.bpe_files import bpe_files, corpus_head
from support.paths import REPO


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    vocab, merges, hf = bpe_files(root)
    return root, vocab, merges, hf


def _first_sample(prefix: str, tokenizer, root) -> np.ndarray:
    data = build_gpt_datasets(GptDataConfig(data_path=(prefix,), split="100,0,0", seq_length=64, global_batch_size=2,
                                            train_iters=2, data_cache_path=root / "cache"), tokenizer)
    return np.asarray(data.train.dataset[0]["tokens"])


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "HuggingFaceTokenizer"])
def test_bpe_data_reads_back_as_the_corpus_text(files, kind):
    root, vocab, merges, hf = files
    spec = dict(tokenizer_type=kind, **({"vocab_file": vocab, "merge_file": merges} if kind == "GPT2BPETokenizer"
                                        else {"tokenizer_model": hf}))
    report = preprocess(PreprocessConfig(input=root / "corpus.jsonl", output_prefix=str(root / kind),
                                         append_eod=True, **spec))
    tokenizer = build_gpt_tokenizer(TokenizerSpec(**{k: str(v) if k != "tokenizer_type" else v
                                                     for k, v in spec.items()}))
    assert tokenizer.vocab_size == 600 and tokenizer.eod == 0  # <|endoftext|> is the first special token
    tokens = _first_sample(report.prefixes["text"], tokenizer, root)
    text = tokenizer.detokenize([int(t) for t in tokens if t != tokenizer.eod])
    corpus = "".join(json.loads(line)["text"] for line in (root / "corpus.jsonl").read_text().splitlines())
    assert len(text) > 100 and text[:40] in corpus


def test_gpt2_bpe_and_a_directory_of_the_same_files_tokenize_alike(files):
    root, vocab, merges, hf = files
    gpt2 = build_gpt_tokenizer(TokenizerSpec(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab),
                                             merge_file=str(merges)))
    fast = build_gpt_tokenizer(TokenizerSpec(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(hf)))
    text = (root / "corpus.jsonl").read_text()[:2000]
    assert list(gpt2.tokenize(text)) == list(fast.tokenize(text))
    assert gpt2_bpe_directory(vocab, merges) == gpt2_bpe_directory(vocab, merges)  # one directory per file pair


def test_pre_tokenized_ids_read_with_the_null_tokenizer(tmp_path):
    """NullTokenizer: ids written by another tool, read as they are (eod = --vocab-size - 1)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, 99, size=int(n)), 99) for n in rng.integers(20, 80, size=40)]
    builder = IndexedDatasetBuilder(str(tmp_path / "ids.bin"), dtype=np.uint16)
    for doc in docs:
        builder.add_document(np.asarray(doc, dtype=np.uint16), [len(doc)])
    builder.finalize(str(tmp_path / "ids.idx"))
    tokenizer = build_gpt_tokenizer(TokenizerSpec(tokenizer_type="NullTokenizer", vocab_size=100))
    assert tokenizer.eod == 99
    tokens = _first_sample(str(tmp_path / "ids"), tokenizer, tmp_path)
    assert np.isin(tokens, np.concatenate(docs)).all() and (tokens == 99).any()


def test_llama2_tokenizer_is_the_sentencepiece_model(tmp_path):
    from megatron_het.data.tokenizer import TokenizerTrainConfig, train_tokenizer

    model = train_tokenizer(TokenizerTrainConfig(input=corpus_head(tmp_path, 100), output_prefix=tmp_path / "sp",
                                                 vocab_size=400)).model_path
    llama = build_gpt_tokenizer(TokenizerSpec(tokenizer_type="Llama2Tokenizer", tokenizer_model=str(model)))
    assert list(llama.tokenize("hello world")) == list(
        build_gpt_tokenizer(TokenizerSpec(tokenizer_model=str(model))).tokenize("hello world"))


BASE = ["--hetero-cluster", str(REPO / "examples/clusters/cpu-demo.yaml"), "--hetero-plan",
        str(REPO / "examples/plans/cpu-demo-hetero.json"), "--num-layers", "4", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
        "--train-iters", "2", "--lr", "1e-3"]


def test_pretrain_takes_megatrons_gpt2_flags(files):
    root, vocab, merges, _ = files
    args = parse_args(BASE + ["--data-path", str(root / "GPT2BPETokenizer_text_document"), "--tokenizer-type",
                              "GPT2BPETokenizer", "--vocab-file", str(vocab), "--merge-file", str(merges)])
    assert args.model.vocab_size == 600 and args.data.vocab_file == str(vocab)


@pytest.mark.parametrize("extra,message", [
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"], "needs --merge-file"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "gpt2"], "hub names are not fetched"),
    (["--tokenizer-type", "NullTokenizer"], "needs --vocab-size"),
    (["--tokenizer-type", "BertWordPieceCase"], "a GPT dataset takes one of"),
])
def test_tokenizer_flags_that_cannot_load_exit_2_before_any_download(extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + ["--data-path", "d"] + extra)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_nothing_reaches_the_network(files, monkeypatch):
    """GPT-2 files load with every hub request failing at once (megatron-core's own path would ask
    huggingface.co for gpt2's settings and retry for about 30 s)."""
    root, vocab, merges, _ = files
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    tok = build_gpt_tokenizer(TokenizerSpec(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab),
                                            merge_file=str(merges)))
    assert tok.vocab_size == 600 and os.environ["HF_HUB_OFFLINE"] == "1"


def test_mock_data_is_megatrons_learnable_sequence():
    """--mock-data: megatron-core's MockGPTDataset (runs 1, 2, 3, ... ending in eod) through a
    NullTokenizer over the model's vocabulary when no tokenizer is given, as Megatron-LM's scripts do."""
    from megatron_het.cli.pretrain import batch_fns

    args = parse_args(BASE + ["--mock-data", "--vocab-size", "512", "--micro-batch-size", "2",
                              "--global-batch-size", "16", "--eval-iters", "1"])
    train, valid = batch_fns(args)
    rows = train(0, range(16))
    assert rows.shape == (16, 65) and valid is not None
    steps = (rows[:, 1:] - rows[:, :-1]).flatten()
    eod = 511  # NullTokenizer: vocab_size - 1
    assert ((steps == 1) | (rows[:, 1:].flatten() == eod) | (rows[:, :-1].flatten() == eod)).all()
    assert not (train(0, range(16)) - train(1, range(16))).eq(0).all()  # each iteration its own samples


def test_tiktoken_data_reads_back_as_the_corpus_text(tmp_path):
    """TikTokenizer (Llama-3, Nemotron): megatron-core's tiktoken tokenizer over a vocabulary JSON, with
    --vocab-size = its entries + 1000 special tokens, as Megatron-LM passes it."""
    from support.tiktoken_files import SPECIAL, tiktoken_vocab

    vocab, size = tiktoken_vocab(tmp_path)
    report = preprocess(PreprocessConfig(input=tmp_path / "corpus.jsonl", output_prefix=str(tmp_path / "tik"),
                                         tokenizer_type="TikTokenizer", tokenizer_model=vocab, vocab_size=size,
                                         append_eod=True))
    tokenizer = build_gpt_tokenizer(TokenizerSpec(tokenizer_type="TikTokenizer", tokenizer_model=str(vocab),
                                                  vocab_size=size))
    assert tokenizer.vocab_size == size and tokenizer.eod < SPECIAL  # eod is a special token: "</s>"
    text = (tmp_path / "corpus.jsonl").read_text()[:3000]
    ids = list(tokenizer.tokenize(text))
    assert tokenizer.detokenize(ids) == text and len(ids) < len(text.encode()) * 0.7  # merges are used
    assert min(ids) >= SPECIAL  # text never maps onto special tokens
    tokens = _first_sample(report.prefixes["text"], tokenizer, tmp_path)
    sample = tokenizer.detokenize([int(t) for t in tokens if t != tokenizer.eod])
    corpus = "".join(json.loads(line)["text"] for line in (tmp_path / "corpus.jsonl").read_text().splitlines())
    assert len(sample) > 64 and sample[:40] in corpus  # 64 tokens, several bytes each


def test_tiktoken_refusals_name_the_fix(tmp_path, monkeypatch):
    import sys

    from support.tiktoken_files import tiktoken_vocab

    vocab, size = tiktoken_vocab(tmp_path, merges=10)
    with pytest.raises(DataInputError, match=r"--vocab-size = its entries \+ 1000 special tokens"):
        build_gpt_tokenizer(TokenizerSpec(tokenizer_type="TikTokenizer", tokenizer_model=str(vocab)))  # 131072
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # not installed
    with pytest.raises(DataInputError, match=r"TikTokenizer needs the tiktoken package.*pip install tiktoken"):
        build_gpt_tokenizer(TokenizerSpec(tokenizer_type="TikTokenizer", tokenizer_model=str(vocab), vocab_size=size))


def test_pretrain_takes_megatrons_tiktoken_flags(tmp_path):
    """--vocab-size reaches TikTokenizer as Megatron-LM hands it over, and the model's vocabulary is the
    tokenizer's (special tokens included)."""
    from megatron_het.runtime.arguments import tokenizer_spec
    from support.tiktoken_files import tiktoken_vocab

    vocab, size = tiktoken_vocab(tmp_path, merges=10)
    args = parse_args(BASE + ["--data-path", "d", "--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(vocab),
                              "--vocab-size", str(size)])
    assert tokenizer_spec(args.data).vocab_size == size and args.model.vocab_size == size
