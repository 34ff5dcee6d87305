"""Train/valid/test GPT samples from indexed datasets, through megatron-core's dataset builder.

``build_gpt_datasets`` wraps ``BlendedMegatronDatasetBuilder`` + ``GPTDatasetConfig`` (blending,
``--split``, shuffling, multi-epoch, index caching all stay megatron-core's). ``gpt_batch_fn`` then
turns a split into the trainers' ``batch_fn(iteration, indices)``: row ``i`` of iteration ``t``'s
global batch is dataset sample ``t * global_batch_size + i``, so every plan, however it divides the
global batch among replicas and micro-batches, sees exactly the same samples.

Distributed: with a process group initialised, the call is collective over the default group
(megatron-core builds the index cache on rank 0, barriers, then the other ranks load it). Without
one, the calling process builds (or loads) the cache itself. The C++ helper megatron-core needs
(``helpers_cpp``) ships compiled in the megatron-core wheel, so nothing is compiled at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_het.data.jsonl import DataInputError

SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True, kw_only=True)
class GptDataConfig:
    """Megatron-LM data arguments (same names) that decide which samples exist."""

    data_path: tuple[str, ...]  # --data-path: "PREFIX" or "W1 PREFIX1 W2 PREFIX2 ..." (prefix without .bin/.idx)
    split: str = "949,50,1"  # --split: train,valid,test weights over documents
    seq_length: int  # tokens per sample fed to the model (each sample carries one more for the label)
    seed: int = 1234  # --seed: document/sample shuffling
    global_batch_size: int  # samples per iteration over all replicas
    train_iters: int  # train samples needed = train_iters * global_batch_size (fresh run)
    eval_iters: int = 0  # batches per evaluation; 0 builds no valid/test samples
    eval_interval: int = 1000  # iterations between evaluations (sizes the valid split as Megatron-LM)
    data_cache_path: Path | None = None  # --data-cache-path: index cache; None: "cache" next to the first prefix
    # a resumed run: the checkpoint's iteration and consumed samples (train.data_position); it reads
    # train samples up to resume_consumed_samples + (train_iters - resume_iteration) * global_batch_size
    resume_iteration: int = 0
    resume_consumed_samples: int = 0
    # Megatron-LM's --mock-data: megatron-core's MockGPTDataset (documents 1, 2, 3, ... eod of random
    # lengths: learnable) instead of data_path, which is then empty
    mock: bool = False

    def __post_init__(self) -> None:
        for name in ("seq_length", "global_batch_size", "train_iters", "eval_interval"):
            value = getattr(self, name)
            if value < 1:
                raise DataInputError(f"{name}: got {value}, the minimum is 1. Fix: pass --{name.replace('_', '-')} >= 1.")
        if self.eval_iters < 0:
            raise DataInputError(f"eval_iters: got {self.eval_iters}, the minimum is 0. Fix: pass --eval-iters >= 0.")
        if isinstance(self.data_path, str):
            raise DataInputError(f"data_path: got the string {self.data_path!r}, expected a tuple of strings. "
                             f"Fix: pass data_path=({self.data_path!r},).")
        if not self.data_path and not self.mock:
            raise DataInputError("data_path: got nothing. Fix: pass --data-path PREFIX (from tools/preprocess_data.py).")
        weights = _split_weights(self.split)
        if weights is None or len(weights) > 3 or sum(weights) <= 0:
            raise DataInputError(f"split: got {self.split!r}; expected up to 3 non-negative weights with a positive sum. "
                             "Fix: pass --split like 949,50,1.")

    @property
    def prefixes(self) -> tuple[str, ...]:
        """Dataset prefixes named in data_path (weights dropped)."""
        if len(self.data_path) % 2 == 0 and all(_is_number(w) for w in self.data_path[::2]):
            return tuple(self.data_path[1::2])
        return self.data_path

    def num_samples(self) -> list[int]:
        """Samples per split, as Megatron-LM: train, valid (every evaluation), test (one evaluation)."""
        gbs = self.global_batch_size
        evaluations = self.train_iters // self.eval_interval + 1
        train = max(self.train_iters * gbs,
                    self.resume_consumed_samples + (self.train_iters - self.resume_iteration) * gbs)
        return [train, evaluations * self.eval_iters * gbs, self.eval_iters * gbs]

    def cache_dir(self) -> Path | None:
        """Where megatron-core caches document/sample/shuffle indices; None: mock data without a
        data_cache_path, built in memory."""
        if self.data_cache_path is not None:
            return Path(self.data_cache_path)
        if self.mock:
            return None
        return Path(self.prefixes[0]).resolve().parent / "cache"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _split_weights(split: str) -> list[float] | None:
    """``"949,50,1"`` -> ``[949.0, 50.0, 1.0]``; None if any part is not a non-negative number."""
    parts = [p.strip() for p in split.split(",")]
    if not all(_is_number(p) and float(p) >= 0 for p in parts):
        return None
    return [float(p) for p in parts]


@dataclass(frozen=True, kw_only=True)
class GptSplit:
    """One split's megatron-core dataset and the batch geometry that maps iterations to samples."""

    name: str  # "train", "valid" or "test"
    dataset: Any  # megatron-core GPTDataset (or BlendedDataset for a weighted --data-path)
    global_batch_size: int  # samples per iteration
    seq_length: int  # tokens per sample fed to the model

    @property
    def num_samples(self) -> int:
        """Samples available (at least the number requested)."""
        return len(self.dataset)

    @property
    def num_iterations(self) -> int:
        """Whole global batches available."""
        return len(self.dataset) // self.global_batch_size


@dataclass(frozen=True, kw_only=True)
class GptDatasets:
    """The three splits; valid/test are None when the split weight or eval_iters is 0."""

    train: GptSplit  # training samples
    valid: GptSplit | None  # evaluation samples
    test: GptSplit | None  # final test samples


def check_prefixes(prefixes: tuple[str, ...]) -> None:
    """Every prefix needs both files; the error names the missing one and how to make it."""
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if not Path(prefix + suffix).is_file():
                raise DataInputError(
                    f"data_path: {prefix + suffix!r} does not exist. Fix: pass --data-path as the prefix written by "
                    "tools/preprocess_data.py (e.g. data/corpus_text_document, without .bin/.idx).")


def split_weight(split: str, index: int) -> float:
    """Weight of split ``index`` in a --split string (missing trailing weights are 0)."""
    weights = _split_weights(split) or []
    return weights[index] if index < len(weights) else 0.0


def split_document_counts(prefix: str, split: str) -> list[int]:
    """Documents of ``prefix`` in the train, valid and test splits, by megatron-core's own rounding."""
    import megatron_het.platform  # noqa: F401
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    documents = IndexedDataset(prefix).sequence_lengths.shape[0]  # GPTDataset splits by sequence
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [0 if bounds is None else int(round(bounds[1] * documents)) - int(round(bounds[0] * documents))
            for bounds in matrix]


def build_gpt_datasets(config: GptDataConfig, tokenizer: Any) -> GptDatasets:
    """Build the splits with megatron-core; ``tokenizer`` comes from ``load_tokenizer`` (needs eod, pad)."""
    check_prefixes(config.prefixes)
    import megatron_het.platform  # noqa: F401  (triton import guard before megatron.core)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.utils import get_blend_from_list

    cache = config.cache_dir()
    gpt_config = GPTDatasetConfig(
        random_seed=config.seed, sequence_length=config.seq_length,
        blend=None if config.mock else get_blend_from_list(list(config.data_path)), split=config.split,
        path_to_cache=None if cache is None else str(cache), tokenizer=tokenizer,  # blend None: megatron-core sets mock itself
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False)  # trainers use tokens only; the causal mask is built by the model
    sizes: list[int | None] = list(config.num_samples())
    for index, name in enumerate(SPLIT_NAMES if not config.mock else ()):
        empty = [p for p in config.prefixes if split_document_counts(p, config.split)[index] == 0]
        if not empty or split_weight(config.split, index) == 0:
            continue
        if index == 0 or len(config.prefixes) > 1:
            # megatron-core loops forever drawing samples (even 0 of them) from a split without documents.
            raise DataInputError(
                f"split: {config.split!r} gives the {name} split 0 documents of {str(empty[0])!r} "
                f"({split_document_counts(empty[0], config.split)} per split). Fix: raise the {name} weight "
                f"in --split{', or set it to 0' if index else ''}.")
        sizes[index] = None  # one prefix: build the empty split without a sample target, then drop it
    built = BlendedMegatronDatasetBuilder(MockGPTDataset if config.mock else GPTDataset, sizes, lambda: True,
                                          gpt_config).build()
    splits: list[GptSplit | None] = []
    for name, dataset, size in zip(SPLIT_NAMES, built, sizes):
        usable = dataset is not None and bool(size) and len(dataset) > 0
        splits.append(GptSplit(name=name, dataset=dataset, global_batch_size=config.global_batch_size,
                               seq_length=config.seq_length) if usable else None)
    if splits[0] is None:
        raise DataInputError(f"split: {config.split!r} leaves no training documents in {list(config.prefixes)}. "
                             "Fix: give the first --split weight a positive share, or use a larger corpus.")
    return GptDatasets(train=splits[0], valid=splits[1], test=splits[2])


def sample_row(dataset: Any, index: int) -> torch.Tensor:
    """Sample ``index`` as one LongTensor of seq_length + 1 tokens (inputs, then the last label)."""
    sample = dataset[index]
    return torch.cat((sample["tokens"], sample["labels"][-1:])).long()


class GptBatches:
    """A split as the trainers' ``batch_fn(iteration, indices)`` -> LongTensor ``[len(indices), seq_length + 1]``.

    Row ``k`` is dataset sample ``iteration * global_batch_size + indices[k]`` (0-based iteration,
    ``indices`` within the global batch), independent of how a plan splits the batch. A resumed run
    reads by sample instead (``samples``, through ``train.data_position.positioned_batches``): the
    global batch starting at the checkpoint's consumed-samples count.
    """

    def __init__(self, dataset: GptSplit) -> None:
        self.split = dataset

    def __call__(self, iteration: int, indices: range) -> torch.Tensor:
        return self.samples(iteration * self.split.global_batch_size, indices, iteration=iteration)

    def samples(self, first: int, indices: range, *, iteration: int | None = None) -> torch.Tensor:
        """Rows ``first + i`` for ``i`` in ``indices`` (``first``: the global batch's first sample;
        ``iteration``: its 0-based iteration, for the error message)."""
        split, gbs = self.split, self.split.global_batch_size
        available = split.num_samples
        rows = []
        for i in indices:
            if not 0 <= i < gbs:
                raise ValueError(f"indices: {i} is outside the global batch 0..{gbs - 1}. "
                                 "Fix: pass indices within the global batch size.")
            sample = first + i
            if not 0 <= sample < available:
                where = f"iteration: {iteration}" if iteration is not None else f"the batch from sample {first}"
                raise ValueError(
                    f"{where} needs {split.name} sample {sample}, but the split has {available} "
                    f"({available // gbs} iterations of {gbs}). Fix: build the datasets with train_iters/eval_iters "
                    "covering every iteration you run (a resumed run: from the checkpoint's consumed samples on, "
                    "GptDataConfig.resume_consumed_samples).")
            rows.append(sample_row(split.dataset, sample))
        if not rows:
            return torch.empty((0, split.seq_length + 1), dtype=torch.long)
        return torch.stack(rows)


def gpt_batch_fn(dataset: GptSplit) -> GptBatches:
    """``batch_fn(iteration, indices)`` of ``dataset`` (``GptBatches``)."""
    return GptBatches(dataset)
