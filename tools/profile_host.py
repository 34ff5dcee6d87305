#!/usr/bin/env python
"""Shim: `python tools/profile_host.py ...` runs megatron_het.cli.profile_host (console script: megatron-het-profile-host)."""

from megatron_het.cli.profile_host import main

if __name__ == "__main__":
    raise SystemExit(main())
