"""Plan JSON: round trip, atomic save, and errors that name the key."""

import copy
import json
import os
from dataclasses import replace

import pytest

from megatron_het.plan import PLAN_FORMAT_VERSION, Plan, PlanError

EXAMPLES = ("examples/plans/cpu-demo-hetero.json", "examples/plans/cpu-demo-2replicas.json")


@pytest.mark.parametrize("path", EXAMPLES)
def test_examples_round_trip_exactly(path, tmp_path):
    plan = Plan.load(path)
    assert Plan.from_dict(plan.to_dict()) == plan
    out = tmp_path / "p.json"
    plan.save(out)
    assert Plan.load(out) == plan
    # The saved text is byte-identical to the example (stable formatting).
    with open(path, encoding="utf-8") as f:
        assert out.read_text(encoding="utf-8") == f.read()


def test_hetero_example_contents():
    plan = Plan.load(EXAMPLES[0])
    (replica,) = plan.replicas
    assert [s.island for s in replica.stages] == ["fast", "slow"]
    assert [s.ranks for s in replica.stages] == [(0, 1), (2, 3)]
    assert [s.layers for s in replica.stages] == [(0, 3), (3, 4)]
    assert replica.num_micro_batches == 8 and plan.micro_batch_size == 2 and plan.global_batch_size == 16
    assert plan.world_size == 4 and replica.ranks == (0, 1, 2, 3)
    two = Plan.load(EXAMPLES[1])
    assert [r.num_micro_batches for r in two.replicas] == [6, 2]
    assert [r.stages[0].layers for r in two.replicas] == [(0, 4), (0, 4)]


def test_round_trip_keeps_every_field():
    plan = replace(Plan.load(EXAMPLES[0]), schedule="zb-h1", sequence_parallel=True,
                   use_distributed_optimizer=True, predicted={"iteration_time_s": 1.25, "notes": "a [1,2]"})
    d = plan.to_dict()
    assert d["format"] == "megatron-het-plan" and d["version"] == PLAN_FORMAT_VERSION
    back = Plan.from_dict(json.loads(plan.to_json()))
    assert back == plan
    assert back.predicted == {"iteration_time_s": 1.25, "notes": "a [1,2]"}


def test_to_json_puts_int_lists_on_one_line():
    text = Plan.load(EXAMPLES[0]).to_json()
    assert '"ranks": [0, 1],' in text and '"layers": [3, 4],' in text and text.endswith("}\n")


def _base() -> dict:
    return Plan.load(EXAMPLES[0]).to_dict()


def test_unknown_key_is_named():
    d = _base()
    d["replicas"][0]["stages"][1]["rank"] = [2]
    with pytest.raises(PlanError) as e:
        Plan.from_dict(d, source="x.json")
    msg = str(e.value)
    assert msg.startswith("x.json: replicas[0].stages[1].rank: unknown key 'rank'")
    assert "allowed keys: island, device_type, ranks" in msg


def test_unknown_top_level_key():
    d = _base()
    d["schedul"] = "1f1b"
    with pytest.raises(PlanError, match="^schedul: unknown key 'schedul'"):
        Plan.from_dict(d)


def test_wrong_version_and_format():
    d = _base()
    d["version"] = 2
    with pytest.raises(PlanError) as e:
        Plan.from_dict(d)
    assert str(e.value).startswith("version: unsupported plan format version 2 (this megatron-het reads version 1)")
    d = _base()
    d["format"] = "something-else"
    with pytest.raises(PlanError, match='format: not a megatron-het plan.*"format": "megatron-het-plan"'):
        Plan.from_dict(d)
    d = _base()
    del d["version"]
    with pytest.raises(PlanError, match="version: required key is missing"):
        Plan.from_dict(d)


def test_type_errors_name_the_path():
    d = _base()
    d["replicas"][0]["stages"][0]["ranks"] = [0, "1"]
    with pytest.raises(PlanError, match=r"replicas\[0\]\.stages\[0\]\.ranks\[1\]: expected an integer \(got '1'\)"):
        Plan.from_dict(d)
    d = _base()
    d["replicas"][0]["num_micro_batches"] = True
    with pytest.raises(PlanError, match=r"replicas\[0\]\.num_micro_batches: expected an integer"):
        Plan.from_dict(d)
    d = _base()
    d["replicas"][0]["stages"][1]["layers"] = [3]
    with pytest.raises(PlanError, match=r"replicas\[0\]\.stages\[1\]\.layers: expected 2 numbers"):
        Plan.from_dict(d)
    d = _base()
    del d["replicas"][0]["stages"][0]["island"]
    with pytest.raises(PlanError, match=r"replicas\[0\]\.stages\[0\]\.island: required key is missing"):
        Plan.from_dict(d)


def test_optional_keys_default():
    d = _base()
    for key in ("schedule", "virtual_pipeline_size", "sequence_parallel", "use_distributed_optimizer",
                "predicted"):
        del d[key]
    for s in d["replicas"][0]["stages"]:
        del s["recompute"], s["tp_comm_overlap"]
    assert Plan.from_dict(d) == Plan.load(EXAMPLES[0])


def test_load_reports_bad_json_with_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "megatron-het-plan",\n "version": 1,,}', encoding="utf-8")
    with pytest.raises(PlanError) as e:
        Plan.load(bad)
    assert str(e.value).startswith(f"{bad}: line 2 column")
    assert "invalid JSON" in str(e.value)


def test_save_is_atomic_and_leaves_no_temp(tmp_path, monkeypatch):
    plan = Plan.load(EXAMPLES[0])
    out = tmp_path / "plan.json"
    out.write_text("old", encoding="utf-8")
    calls = []
    real_replace = os.replace

    def spy(src, dst):
        calls.append((os.path.dirname(src), os.fspath(dst)))
        # The temp file is complete before it replaces the target.
        assert Plan.load(src) == plan
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    plan.save(out)
    assert calls == [(str(tmp_path), str(out))]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    changed = replace(plan, global_batch_size=32)
    with pytest.raises(OSError, match="disk full"):
        changed.save(out)
    assert Plan.load(out) == plan  # old content intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_to_dict_detaches_predicted():
    plan = replace(Plan.load(EXAMPLES[0]), predicted={"per_stage": [1.0, 2.0]})
    d = plan.to_dict()
    d["predicted"]["per_stage"].append(3.0)
    assert plan.predicted == {"per_stage": [1.0, 2.0]}
    assert copy.deepcopy(plan) == plan
