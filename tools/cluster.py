#!/usr/bin/env python
"""Shim: `python tools/cluster.py ...` runs megatron_het.cli.cluster (console script: megatron-het-cluster)."""

from megatron_het.cli.cluster import main

if __name__ == "__main__":
    raise SystemExit(main())
