"""Shared set-up for every test tier (tests/unit/<package>/, tests/multiproc/, tests/gpu/).

tests/ goes on sys.path so that rank functions (``workers.*``) and helpers (``support.*``) import
by name in the test process and in processes it spawns.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
