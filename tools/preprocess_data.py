#!/usr/bin/env python
"""Shim: `python tools/preprocess_data.py ...` runs megatron_het.cli.preprocess (console script: megatron-het-preprocess)."""

from megatron_het.cli.preprocess import main

if __name__ == "__main__":
    raise SystemExit(main())
