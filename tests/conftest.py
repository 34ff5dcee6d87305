"""Shared set-up for every test tier (tests/unit/<package>/, tests/multiproc/, tests/gpu/).

tests/ goes on sys.path so that rank functions (``workers.*``) and helpers (``support.*``) import
by name in the test process and in processes it spawns.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# megatron-core imports triton unguarded; the platform package's guard must be in place before any test
# module imports megatron.core, whichever test file runs first (or alone).
import megatron_het.platform  # noqa: E402,F401
