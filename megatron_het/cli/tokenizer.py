"""Train a small SentencePiece (BPE, byte fallback) tokenizer on a JSONL corpus.

    python tools/train_tokenizer.py --input examples/data/corpus.jsonl --json-key text \\
        --vocab-size 512 --output-prefix data/sp512

Writes {output-prefix}.model (pass as --tokenizer-model) and {output-prefix}.vocab.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_het.data.tokenizer import MODEL_TYPES, TokenizerTrainConfig, train_tokenizer
from megatron_het.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="train_tokenizer.py", description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="JSONL corpus")
    parser.add_argument("--json-key", default="text", help="key of the text in each line")
    parser.add_argument("--vocab-size", type=int, default=512, help="pieces in the model")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--model-type", default="bpe", choices=MODEL_TYPES, help="SentencePiece algorithm")
    args = parser.parse_args(argv)
    try:
        report = train_tokenizer(TokenizerTrainConfig(input=Path(args.input), json_key=args.json_key,
                                                      vocab_size=args.vocab_size,
                                                      output_prefix=Path(args.output_prefix),
                                                      model_type=args.model_type))
    except UserError as err:  # bugs are not caught: they surface as tracebacks
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"trained {args.model_type} tokenizer: {report.vocab_size} pieces from {report.num_documents} documents "
          f"-> {report.model_path}")
    return 0
