"""docs/plan-format.md documents every key a pipeline plan file has: its example is the example plan
file it names, and its top-level table lists every key ``Plan.to_dict`` writes (``precision`` was
missing from both), with the precision default the loader applies."""

from __future__ import annotations

import json
import re

from megatron_het.plan import Plan
from megatron_het.plan.types import DEFAULT_PRECISION

from support.paths import REPO

DOC = (REPO / "docs" / "plan-format.md").read_text()


def top_level_rows() -> dict[str, str]:
    table = DOC.split("## Top level", 1)[1].split("\n\n", 2)[1]
    return {m.group(1): line for line in table.splitlines() if (m := re.match(r"\| `(\w+)` \|", line))}


def test_doc_example_is_the_example_plan_file():
    example = json.loads(re.search(r"```json\n(.*?)```", DOC, re.S).group(1))
    assert example == json.loads((REPO / "examples/plans/cpu-demo-hetero.json").read_text())


def test_top_level_table_lists_every_written_key():
    plan = Plan.load(REPO / "examples/plans/cpu-demo-hetero.json")
    rows = top_level_rows()
    assert set(plan.to_dict()) - set(rows) == set()
    assert f'`"{DEFAULT_PRECISION}"`' in rows["precision"].split("|")[3]  # the default column


def test_a_plan_without_precision_reads_as_the_documented_default():
    d = json.loads((REPO / "examples/plans/cpu-demo-hetero.json").read_text())
    del d["precision"]
    assert Plan.from_dict(d).precision == DEFAULT_PRECISION == "bf16"
    assert "A plan file without `precision` is a bf16 plan" in DOC
