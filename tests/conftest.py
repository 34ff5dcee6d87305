import os
import sys

# Rank functions for spawned processes live in tests/; make them importable by name.
sys.path.insert(0, os.path.dirname(__file__))
