#!/usr/bin/env python
"""Shim: `python tools/calibrate.py ...` runs megatron_het.cli.calibrate (console script: megatron-het-calibrate)."""

from megatron_het.cli.calibrate import main

if __name__ == "__main__":
    raise SystemExit(main())
