"""Write the example corpus: docstrings of Python's standard library as JSONL.

    python tools/make_corpus.py --output examples/data/corpus.jsonl [--max-bytes 1000000]

Reads the standard library of the running interpreter (or --stdlib-dir) with ``ast``; nothing is
downloaded. The text is under the PSF license (see examples/data/README.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_het.data.corpus import CorpusConfig, check_output, default_stdlib_dir, stdlib_documents, write_jsonl
from megatron_het.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make_corpus.py", description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--json-key", default="text", help="key of the text field in each line")
    parser.add_argument("--stdlib-dir", default=None, help="standard library folder (default: this Python's)")
    parser.add_argument("--max-bytes", type=int, default=1_000_000, help="size limit of the output file")
    args = parser.parse_args(argv)
    try:
        config = CorpusConfig(stdlib_dir=Path(args.stdlib_dir) if args.stdlib_dir else default_stdlib_dir(),
                              max_bytes=args.max_bytes)
        check_output(Path(args.output))  # before reading the standard library
        texts = stdlib_documents(config)
        size = write_jsonl(texts, Path(args.output), key=args.json_key)
    except UserError as err:  # bugs are not caught: they surface as tracebacks
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(texts)} documents, {size} bytes to {args.output} "
          f"(Python {sys.version.split()[0]} standard library docstrings)")
    return 0
