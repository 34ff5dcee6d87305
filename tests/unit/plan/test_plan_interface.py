"""Both plan kinds behind one interface; one loader; sharded plans fail as PlanError (#13 item 2)."""

from __future__ import annotations

import json

import pytest

from megatron_het.cluster import load_cluster, load_model
from megatron_het.errors import UserError
from megatron_het.plan import (
    AnyPlan,
    Plan,
    PlanError,
    RankShare,
    ShardedPlan,
    load_any_plan,
    plan_to_json,
    save_plan,
    validate_plan,
)

from support.paths import EXAMPLES

CPU_DEMO = EXAMPLES / "clusters" / "cpu-demo.yaml"
TINY = EXAMPLES / "models" / "tiny-cpu.yaml"
PIPELINE = EXAMPLES / "plans" / "cpu-demo-hetero.json"


def _sharded(**kw) -> ShardedPlan:
    ranks = tuple(RankShare(rank=i, island="fast" if i < 2 else "slow", device_type="CPU", micro_batch_size=1,
                            num_micro_batches=3 if i < 2 else 1, shard_fraction=0.25) for i in range(4))
    return ShardedPlan(ranks=ranks, global_batch_size=8, **kw)


def _kinds() -> list[AnyPlan]:
    return [Plan.load(PIPELINE), _sharded(predicted={"iteration_time_s": 0.5, "tokens_per_s": 1000.0})]


@pytest.mark.parametrize("index", [0, 1], ids=["pipeline", "sharded"])
def test_both_kinds_implement_the_interface_and_round_trip_through_one_loader(tmp_path, index):
    plan = _kinds()[index]
    assert isinstance(plan, AnyPlan)
    assert plan.world_size == 4 and plan.island_ranks() == {"fast": (0, 1), "slow": (2, 3)}
    plan.validate(load_model(TINY), load_cluster(CPU_DEMO))  # valid: returns None
    validate_plan(plan, load_model(TINY), load_cluster(CPU_DEMO))
    lines = plan.describe()
    assert lines[0].startswith("plan: ") and "4 ranks" in lines[0] and len(lines) >= 2
    save_plan(plan, tmp_path / "p.json")
    assert (tmp_path / "p.json").read_text() == plan.to_json() == plan_to_json(plan)
    assert json.loads(plan.to_json()) == plan.to_dict()
    back = load_any_plan(tmp_path / "p.json")
    assert type(back) is type(plan) and back == plan and back.predicted == plan.predicted


def test_sharded_describe_and_prediction_line():
    lines = _sharded(predicted={"iteration_time_s": 0.5, "tokens_per_s": 1000.0}).describe()
    assert lines[0] == "plan: uneven sharded data parallelism, 4 ranks, global batch 8"
    assert lines[1] == "  rank 0: fast(CPU) micro-batch 1 x 3, state shard 25.00%"
    assert lines[-1] == "  predicted: 500.0 ms/iteration, 1000 tokens/s"


def test_sharded_checks_raise_plan_errors_naming_field_value_and_fix():
    with pytest.raises(PlanError) as info:
        _sharded().__class__(ranks=_sharded().ranks, global_batch_size=9)
    err = info.value
    assert isinstance(err, UserError) and err.field == "global_batch_size" and err.value == 9 and err.fix
    assert str(err).startswith("global_batch_size: the ranks compute 8 samples per iteration")
    with pytest.raises(PlanError, match=r"^ranks\[2\]\.shard_fraction: expected a number in \[0, 1\] \(got 1\.5\)"):
        RankShare(rank=2, island="a", device_type="CPU", micro_batch_size=1, num_micro_batches=1, shard_fraction=1.5)
    with pytest.raises(PlanError, match=r"^ranks\[0\]\.num_micro_batches: must be an integer >= 0 \(got -1\)"):
        RankShare(rank=0, island="a", device_type="CPU", micro_batch_size=1, num_micro_batches=-1, shard_fraction=1)


def test_sharded_plan_against_the_wrong_cluster():
    with pytest.raises(PlanError, match=r"ranks\[0\]\.island: no such island in the cluster \(got 'fast'\)"):
        _sharded().validate(load_model(TINY), load_cluster(EXAMPLES / "clusters" / "cpu-4.yaml"))


@pytest.mark.parametrize(("change", "needle"), [
    (lambda d: d["ranks"][1].pop("shard_fraction"), "ranks[1].shard_fraction: required key is missing"),
    (lambda d: d["ranks"][0].update(micro_batch_size="1"), "ranks[0].micro_batch_size: expected an integer"),
    (lambda d: d["ranks"][0].update(speed=2), "ranks[0].speed: unknown key 'speed'"),
    (lambda d: d.update(ranks=[]), "ranks: expected a non-empty list of ranks"),
    (lambda d: d.update(global_batch_size=7), "global_batch_size: the ranks compute 8 samples"),
    (lambda d: d.update(version=2), "version: this megatron-het reads sharded plan version 1"),
])
def test_sharded_files_fail_as_one_plan_error_naming_the_file(tmp_path, change, needle):
    data = _sharded().to_dict()
    change(data)
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as info:
        load_any_plan(path)
    assert str(info.value).startswith(f"{path}: {needle}"), str(info.value)


@pytest.mark.parametrize(("content", "needle"), [
    (b"\xff\xfe{}", "(file): not UTF-8 text"),
    (("[" * 100_000 + "]" * 100_000).encode(), "(file): JSON nested too deeply"),
    (b'{"format": "megatron-het-sharded-plan"', "line 1 column 39: invalid JSON"),
    (b"[]", "format: unknown plan format"),
])
def test_unreadable_plan_files_are_one_plan_error(tmp_path, content, needle):
    path = tmp_path / "p.json"
    path.write_bytes(content)
    with pytest.raises(PlanError) as info:
        load_any_plan(path)
    assert str(info.value).startswith(f"{path}: {needle}"), str(info.value)
    with pytest.raises(PlanError, match=r"\(file\): is a directory"):
        load_any_plan(tmp_path)  # a directory


def test_a_pipeline_file_is_not_a_sharded_plan():
    with pytest.raises(PlanError, match=r"format: a pipeline plan, not a sharded one"):
        ShardedPlan.load(PIPELINE)
