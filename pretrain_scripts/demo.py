"""`make demo`: heterogeneous training on an emulated two-type CPU cluster, end to end.

1. data: SentencePiece tokenizer and megatron indexed dataset from the shipped corpus (idempotent);
2. plan: the planner picks a plan for examples/clusters/cpu-demo.yaml (islands `fast` and `slow`,
   the latter emulated 2x slower) and the tiny model;
3. train: torchrun starts 4 gloo processes running pretrain_gpt.py with that plan; loss goes down,
   a validation loss is reported, and a checkpoint is written to runs/demo/checkpoints.

Extra arguments go to pretrain_gpt.py unchanged: ``python pretrain_scripts/demo.py --bf16``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN = os.path.join(ROOT, "runs", "demo")
DATA = os.path.join(RUN, "data")


def prepare_data() -> tuple[str, str]:
    from megatron_het.data import PreprocessConfig, TokenizerTrainConfig, preprocess, train_tokenizer

    corpus = os.path.join(ROOT, "examples", "data", "corpus.jsonl")
    os.makedirs(DATA, exist_ok=True)
    model = os.path.join(DATA, "sp512.model")
    if not os.path.exists(model):
        report = train_tokenizer(TokenizerTrainConfig(input=Path(corpus), vocab_size=512,
                                                      output_prefix=Path(DATA, "sp512")))
        print(f"demo: trained tokenizer {report.model_path} ({report.vocab_size} pieces)")
    prefix = os.path.join(DATA, "corpus")
    if not os.path.exists(prefix + "_text_document.idx"):
        report = preprocess(PreprocessConfig(input=Path(corpus), output_prefix=prefix,
                                             tokenizer_type="SentencePieceTokenizer", tokenizer_model=Path(model),
                                             append_eod=True))
        print(f"demo: preprocessed {report.documents} documents, {report.tokens} tokens")
    return model, prefix + "_text_document"


def main() -> int:
    tokenizer, data = prepare_data()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", "29517",
           os.path.join(ROOT, "pretrain_scripts", "pretrain_gpt.py"),
           "--hetero-cluster", os.path.join(ROOT, "examples", "clusters", "cpu-demo.yaml"),
           "--hetero-plan", "auto",
           "--hetero-model", os.path.join(ROOT, "examples", "models", "tiny-cpu.yaml"),
           "--data-path", data, "--tokenizer-model", tokenizer, "--split", "949,50,1",
           "--data-cache-path", os.path.join(DATA, "cache"),
           "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "40",
           "--lr", "3e-3", "--lr-decay-style", "cosine", "--min-lr", "3e-4", "--lr-warmup-iters", "4",
           "--log-interval", "5", "--eval-interval", "20", "--eval-iters", "2",
           "--save", os.path.join(RUN, "checkpoints"), *sys.argv[1:]]  # extra flags pass through (e.g. --bf16)
    print("demo: " + " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd[1:]), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.call(cmd, env=env, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
