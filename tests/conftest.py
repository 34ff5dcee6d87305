"""Shared set-up for every test tier (tests/unit/<package>/, tests/dryrun/, tests/multiproc/, tests/gpu/).

tests/ goes on sys.path so that rank functions (``workers.*``) and helpers (``support.*``) import
by name in the test process and in processes it spawns.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# megatron-core imports triton unguarded; the platform package's guard must be in place before any test
# module imports megatron.core, whichever test file runs first (or alone).
import megatron_het.platform  # noqa: E402,F401

# Every local launch (platform.local_launch.run_local, resilience.launch.run_resilient_local) forks its ranks
# from one server that imported torch and megatron-core once per session, instead of each spawned rank
# importing them again (~7 s of CPU each; an 8-rank launch spent ~30 s of its time importing on 2 cores).
# Same rank functions, environment, working directory and fresh RNG seeds (see preload_in_forkserver).
# MEGATRON_HET_TEST_SPAWN=1 spawns every rank afresh, as the launchers do outside the tests; so does a
# machine with a GPU (a rank forked from a server whose imports touched CUDA could not use CUDA).
from megatron_het.platform import detect_accelerator  # noqa: E402

if os.environ.get("MEGATRON_HET_TEST_SPAWN") != "1" and detect_accelerator().kind == "cpu":
    from megatron_het.platform.local_launch import preload_in_forkserver

    preload_in_forkserver(["megatron_het.platform", "megatron.core", "megatron_het.runtime.hetero_trainer",
                           "megatron_het.runtime.megatron_trainer"])
