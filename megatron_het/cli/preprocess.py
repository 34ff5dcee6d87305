"""Tokenize a JSONL corpus into megatron-core indexed datasets (.bin/.idx), Megatron-LM style.

    python tools/preprocess_data.py --input examples/data/corpus.jsonl --json-keys text \\
        --output-prefix data/corpus --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model data/sp512.model --append-eod --workers 1

Writes {output-prefix}_{key}_document.bin/.idx per json key; pass that prefix as --data-path.
Errors (missing input, missing json key with its line number, missing or bad tokenizer model,
non-UTF-8 input) are one line on stderr and exit code 2; an existing dataset is never touched
by a failed run (files are written under temporary names and renamed on success).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_het.cli.output import undo_created_dirs
from megatron_het.data.preprocess import PreprocessConfig, preprocess
from megatron_het.data.tokenizer import GPT_TOKENIZER_TYPES
from megatron_het.errors import UserError
from megatron_het.utils.progress import Progress, add_progress_argument


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="preprocess_data.py", description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each line")
    parser.add_argument("--output-prefix", required=True, help="prefix of the output .bin/.idx files")
    parser.add_argument("--tokenizer-type", default="SentencePieceTokenizer", choices=GPT_TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-model", help="SentencePiece .model file, or a HuggingFace tokenizer directory")
    parser.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    parser.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    parser.add_argument("--vocab-size", type=int, help="NullTokenizer: ids are below it; TikTokenizer: its vocabulary "
                        "with the special tokens (Megatron-LM's preprocess_data.py --vocab-size)")
    parser.add_argument("--append-eod", action="store_true", help="end each document with the eod token")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    add_progress_argument(parser)
    args = parser.parse_args(argv)
    try:
        config = PreprocessConfig(input=Path(args.input), json_keys=tuple(args.json_keys),
                                  output_prefix=args.output_prefix, tokenizer_type=args.tokenizer_type,
                                  tokenizer_model=args.tokenizer_model and Path(args.tokenizer_model),
                                  vocab_file=args.vocab_file and Path(args.vocab_file),
                                  merge_file=args.merge_file and Path(args.merge_file), append_eod=args.append_eod,
                                  workers=args.workers, vocab_size=args.vocab_size)
        bar = Progress("preprocess", unit="documents", quiet=args.no_progress)
        try:
            with undo_created_dirs(Path(args.output_prefix).parent):  # nothing left behind on failure
                report = preprocess(config, progress=bar.update)
        except UserError:
            bar.quiet = True  # the error line is the whole report
            raise
        bar.close()
    except UserError as err:  # bugs are not caught: they surface as tracebacks
        print(f"error: {err}", file=sys.stderr)
        return 2
    for key, prefix in report.prefixes.items():
        print(f"{key}: {report.documents} documents, {report.tokens[key]} tokens -> {prefix}.bin/.idx")
    if report.skipped_empty:
        print(f"skipped {report.skipped_empty} empty documents")
    return 0
