"""GPTDataset splits via megatron-core's builder, and gpt_batch_fn's plan-independent samples."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megatron_het.data.gpt_data import (
    GptDataConfig,
    build_gpt_datasets,
    gpt_batch_fn,
    sample_row,
    split_document_counts,
)
from megatron_het.data.jsonl import DataInputError
from megatron_het.data.preprocess import PreprocessConfig, preprocess
from megatron_het.data.tokenizer import TokenizerTrainConfig, load_tokenizer, train_tokenizer

from support.paths import REPO, TESTS

CORPUS = REPO / "examples" / "data" / "corpus.jsonl"
SEQ, GBS = 32, 6


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The first 80 shipped documents, tokenized with --append-eod: (dataset prefix, model path)."""
    root = tmp_path_factory.mktemp("gpt")
    with CORPUS.open(encoding="utf-8") as lines:
        subset = [line for line, _ in zip(lines, range(80))]
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(subset), encoding="utf-8")
    model = train_tokenizer(TokenizerTrainConfig(input=corpus, output_prefix=root / "sp512")).model_path
    report = preprocess(PreprocessConfig(input=corpus, output_prefix=str(root / "corpus"), tokenizer_model=model,
                                         append_eod=True))
    return report.prefixes["text"], model


def make_config(prefix: str, cache: Path, **overrides) -> GptDataConfig:
    fields = dict(data_path=(prefix,), split="949,50,1", seq_length=SEQ, seed=1234, global_batch_size=GBS,
                  train_iters=5, eval_iters=2, eval_interval=5, data_cache_path=cache)
    fields.update(overrides)
    return GptDataConfig(**fields)


@pytest.fixture(scope="module")
def datasets(data, tmp_path_factory: pytest.TempPathFactory):
    prefix, model = data
    return build_gpt_datasets(make_config(prefix, tmp_path_factory.mktemp("cache")), load_tokenizer(model))


def test_split_sizes_follow_megatron_rounding(data, datasets) -> None:
    prefix, _ = data
    assert split_document_counts(prefix, "949,50,1") == [76, 4, 0]  # round(0.949*80)=76, round(0.999*80)=80
    train, valid = datasets.train.dataset, datasets.valid.dataset
    assert len(train.indices) == 76 and len(valid.indices) == 4
    assert set(train.indices.tolist()).isdisjoint(valid.indices.tolist())
    assert datasets.test is None  # 0 documents: dropped instead of megatron-core looping forever
    assert datasets.train.num_samples >= 5 * GBS  # at least train_iters * global_batch_size
    assert datasets.valid.num_samples >= 2 * 2 * GBS  # (train_iters // eval_interval + 1) * eval_iters * gbs


def test_batch_shape_and_labels(datasets) -> None:
    batch = gpt_batch_fn(datasets.train)(2, range(GBS))
    assert batch.shape == (GBS, SEQ + 1) and batch.dtype == torch.long
    for i in range(GBS):
        sample = datasets.train.dataset[2 * GBS + i]
        assert torch.equal(batch[i, 1:], sample["labels"])
        assert torch.equal(batch[i, :-1], sample["tokens"])
    assert int(batch.max()) < 512 and int(batch.min()) >= 0


def test_any_split_of_the_global_batch_sees_the_same_samples(datasets) -> None:
    batch_fn = gpt_batch_fn(datasets.train)
    whole = batch_fn(3, range(GBS))
    for pieces in ([range(0, 2), range(2, 6)], [range(0, 1), range(1, 4), range(4, 6)], [range(i, i + 1) for i in range(GBS)]):
        assert torch.equal(torch.cat([batch_fn(3, r) for r in pieces]), whole)
    assert torch.equal(batch_fn(3, range(4, 6)), whole[4:6])
    assert not torch.equal(batch_fn(4, range(GBS)), whole)  # the next iteration moves on
    assert batch_fn(3, range(0)).shape == (0, SEQ + 1)


def test_samples_are_real_text(data, datasets) -> None:
    """Each stretch of a sample between eod tokens occurs inside one preprocessed document."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    documents = IndexedDataset(data[0])
    haystack = [" ".join(map(str, documents[d].tolist())) for d in range(len(documents))]
    row = gpt_batch_fn(datasets.train)(0, range(1))[0].tolist()
    pieces = " ".join(map(str, row)).split(" 2 ")
    longest = max(pieces, key=len)
    assert len(longest.split()) >= 8
    assert any(longest in doc for doc in haystack)


def test_rebuild_from_cache_gives_identical_samples(data, datasets, tmp_path: Path) -> None:
    prefix, model = data
    cache = Path(datasets.train.dataset.config.path_to_cache)
    cached = sorted(p.name for p in cache.iterdir())
    assert any(name.endswith("GPTDataset-train-shuffle_index.npy") for name in cached)
    again = build_gpt_datasets(make_config(prefix, cache), load_tokenizer(model))
    assert torch.equal(gpt_batch_fn(again.train)(1, range(GBS)), gpt_batch_fn(datasets.train)(1, range(GBS)))
    other_seed = build_gpt_datasets(make_config(prefix, tmp_path, seed=7), load_tokenizer(model))
    assert not torch.equal(gpt_batch_fn(other_seed.train)(1, range(GBS)), gpt_batch_fn(datasets.train)(1, range(GBS)))


def test_valid_split_batches(datasets) -> None:
    batch = gpt_batch_fn(datasets.valid)(1, range(GBS))
    assert batch.shape == (GBS, SEQ + 1)
    assert torch.equal(batch[0], sample_row(datasets.valid.dataset, GBS))


def test_batch_fn_errors(datasets) -> None:
    batch_fn = gpt_batch_fn(datasets.train)
    beyond = datasets.train.num_iterations + 1
    with pytest.raises(ValueError, match=rf"iteration: {beyond} needs train sample {beyond * GBS}, but the split has "
                                         rf"{datasets.train.num_samples} \({beyond - 1} iterations of {GBS}\)\. "
                                         r"Fix: build the datasets"):
        batch_fn(beyond, range(GBS))
    with pytest.raises(ValueError, match=r"indices: 6 is outside the global batch 0\.\.5"):
        batch_fn(0, range(4, 7))


def test_config_and_split_errors(data, tmp_path: Path) -> None:
    prefix, model = data
    with pytest.raises(DataInputError, match=r"data_path: '.*nothing_here.bin' does not exist.*preprocess_data.py"):
        build_gpt_datasets(make_config(str(tmp_path / "nothing_here"), tmp_path), None)
    with pytest.raises(ValueError, match=r"seq_length: got 0, the minimum is 1"):
        make_config(prefix, tmp_path, seq_length=0)
    with pytest.raises(ValueError, match=r"data_path: got the string 'abc', expected a tuple"):
        make_config(prefix, tmp_path, data_path="abc")
    with pytest.raises(ValueError, match=r"split: got '90,x,1'"):
        make_config(prefix, tmp_path, split="90,x,1")
    tokenizer = load_tokenizer(model)
    with pytest.raises(DataInputError, match=r"split: '0,1,0' leaves no training documents"):
        build_gpt_datasets(make_config(prefix, tmp_path, split="0,1,0"), tokenizer)
    blend = ("1", prefix, "1", prefix)  # a weighted blend cannot drop an empty split
    with pytest.raises(DataInputError, match=r"split: '949,50,1' gives the test split 0 documents.*\[76, 4, 0\]"):
        build_gpt_datasets(make_config(prefix, tmp_path, data_path=blend), tokenizer)
    only_train = build_gpt_datasets(make_config(prefix, tmp_path, split="1,0,0", eval_iters=0), tokenizer)
    assert only_train.valid is None and only_train.test is None


def distributed_rows(rank: int, world_size: int, prefix: str, model: str, cache: str) -> list[list[int]]:
    """Rank function: every rank builds (rank 0 writes the cache first) and reads iteration 1."""
    import megatron_het.platform  # noqa: F401

    datasets = build_gpt_datasets(make_config(prefix, Path(cache)), load_tokenizer(model))
    return gpt_batch_fn(datasets.train)(1, range(rank * 3, rank * 3 + 3)).tolist()


@pytest.mark.multiproc
def test_builds_under_an_initialised_process_group(data, datasets, tmp_path: Path) -> None:
    from megatron_het.platform.local_launch import run_local

    prefix, model = data
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(TESTS), str(REPO)])}
    rows = run_local(2, distributed_rows, (prefix, str(model), str(tmp_path / "dist_cache")), env=env, timeout_s=300)
    # two replicas each read half of the global batch: together exactly the single-process batch
    expected = gpt_batch_fn(datasets.train)(1, range(GBS))
    assert torch.equal(torch.tensor(rows[0] + rows[1]), expected)
    assert any(p.name.endswith("train-sample_index.npy") for p in (tmp_path / "dist_cache").iterdir())
