#!/usr/bin/env python
"""Shim: `python tools/plan.py ...` runs megatron_het.cli.plan (console script: megatron-het-plan)."""

from megatron_het.cli.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
