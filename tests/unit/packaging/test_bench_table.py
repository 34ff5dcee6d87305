"""bench/run_all.py's table: a row for every bench script, each figure read from its results file, and
bench/README.md showing that table as the results files stand."""

from __future__ import annotations

import importlib.util

from support.paths import REPO


def _run_all():
    spec = importlib.util.spec_from_file_location("bench_run_all", REPO / "bench" / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_bench_script_has_a_row():
    scripts = {p.stem for p in (REPO / "bench").glob("*.py")} - {"harness", "run_all"}
    assert scripts == set(_run_all().ROWS), "add or remove the bench's @row in bench/run_all.py"


def test_readme_table_is_the_results_files():
    lines = _run_all().table()  # raises if a results file lacks what its row reads
    assert "\n".join(lines) in (REPO / "bench" / "README.md").read_text(), (
        "bench/README.md's table differs from the results files: paste 'python bench/run_all.py --table-only'")
