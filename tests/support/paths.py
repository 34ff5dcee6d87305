"""Where things are, for tests at any depth below tests/."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/
REPO = TESTS.parent  # the repository root
GOLDEN = TESTS / "golden"  # expected outputs compared byte for byte
EXAMPLES = REPO / "examples"
