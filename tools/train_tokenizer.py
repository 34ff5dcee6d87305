#!/usr/bin/env python
"""Shim: `python tools/train_tokenizer.py ...` runs megatron_het.cli.tokenizer (console script: megatron-het-tokenizer)."""

from megatron_het.cli.tokenizer import main

if __name__ == "__main__":
    raise SystemExit(main())
