#!/usr/bin/env python
"""Shim: `python tools/predict.py ...` runs megatron_het.cli.predict (console script: megatron-het-predict)."""

from megatron_het.cli.predict import main

if __name__ == "__main__":
    raise SystemExit(main())
