#!/usr/bin/env python
"""Shim: `python tools/checkpoint/convert.py ...` runs megatron_het.cli.convert (console script: megatron-het-convert)."""

from megatron_het.cli.convert import main

if __name__ == "__main__":
    raise SystemExit(main())
