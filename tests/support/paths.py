"""Where things are, for tests at any depth below tests/."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/
REPO = TESTS.parent  # the repository root
GOLDEN = TESTS / "golden"  # expected outputs compared byte for byte
EXAMPLES = REPO / "examples"


def package_modules(package: str = "megatron_het") -> dict[str, Path]:
    """Dotted module name -> source file of every module in ``package`` (packages by their __init__)."""
    out = {}
    for path in sorted((REPO / package).rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out
