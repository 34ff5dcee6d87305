#!/usr/bin/env python
"""Shim: `python tools/slurm.py ...` runs megatron_het.cli.slurm (console script: megatron-het-slurm)."""

from megatron_het.cli.slurm import main

if __name__ == "__main__":
    raise SystemExit(main())
