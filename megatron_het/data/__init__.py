"""Training data: synthetic batches for parity tests, and the real-text pipeline.

Real text: JSONL corpus (``corpus``) -> SentencePiece model (``tokenizer``) -> megatron-core
indexed dataset (``preprocess``) -> megatron-core GPTDataset splits and the trainers'
``batch_fn(iteration, indices)`` (``gpt_data``). megatron-core is imported only when needed.
"""

from megatron_het.data.gpt_data import (
    GptDataConfig,
    GptDatasets,
    GptSplit,
    build_gpt_datasets,
    gpt_batch_fn,
    split_document_counts,
)
from megatron_het.data.jsonl import DataInputError, read_jsonl_texts
from megatron_het.data.preprocess import PreprocessConfig, PreprocessReport, dataset_prefix, preprocess
from megatron_het.data.synthetic import synthetic_batch, synthetic_sample
from megatron_het.data.tokenizer import (
    TokenizerTrainConfig,
    TokenizerTrainReport,
    load_tokenizer,
    train_tokenizer,
)

__all__ = [
    "DataInputError",
    "GptDataConfig",
    "GptDatasets",
    "GptSplit",
    "PreprocessConfig",
    "PreprocessReport",
    "TokenizerTrainConfig",
    "TokenizerTrainReport",
    "build_gpt_datasets",
    "dataset_prefix",
    "gpt_batch_fn",
    "load_tokenizer",
    "preprocess",
    "read_jsonl_texts",
    "split_document_counts",
    "synthetic_batch",
    "synthetic_sample",
    "train_tokenizer",
]
