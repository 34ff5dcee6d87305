#!/usr/bin/env python
"""Shim: `python tools/make_corpus.py ...` runs megatron_het.cli.make_corpus (console script: megatron-het-make-corpus)."""

from megatron_het.cli.make_corpus import main

if __name__ == "__main__":
    raise SystemExit(main())
