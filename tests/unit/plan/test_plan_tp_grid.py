"""A stage's 3D tensor-parallel grid (``tp_grid``): JSON round trip, parse errors, and validation
against the model's sizes, each message naming the field, both numbers and the fix."""

import json

import pytest

from megatron_het.cluster import model_from_dict
from megatron_het.plan import Plan, PlanError, ReplicaPlan, StagePlan, validate_plan


def _model(**kw):
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=512)
    base.update(kw)
    return model_from_dict(base)


def _plan(grid, ranks=(0, 1, 2, 3), **stage_kw):
    stages = (StagePlan(island="fast", device_type="CPU", ranks=tuple(ranks), layers=(0, 2), tp_grid=grid,
                        **stage_kw),
              StagePlan(island="fast", device_type="CPU", ranks=(len(ranks), len(ranks) + 1), layers=(2, 4)))
    return Plan(replicas=(ReplicaPlan(stages=stages, num_micro_batches=4),), micro_batch_size=2, global_batch_size=8)


def test_tp_grid_round_trips_and_1d_stages_keep_their_json():
    plan = _plan((2, 2, 1))
    d = plan.to_dict()
    assert d["replicas"][0]["stages"][0]["tp_grid"] == [2, 2, 1]
    assert "tp_grid" not in d["replicas"][0]["stages"][1]  # 1D plans are written exactly as before
    back = Plan.from_dict(json.loads(json.dumps(d)))
    assert back == plan and back.replicas[0].stages[0].tp_grid == (2, 2, 1)
    validate_plan(back, _model())


@pytest.mark.parametrize("value, needle", [
    ([2, 2], "expected 3 axis sizes >= 1 [gx, gy, gz], found 2 number(s)"),
    ([2, 0, 2], "expected 3 axis sizes >= 1"),
    ("2x2x1", "expected a list of integers"),
])
def test_tp_grid_parse_errors_name_the_field(value, needle):
    d = _plan((2, 2, 1)).to_dict()
    d["replicas"][0]["stages"][0]["tp_grid"] = value
    with pytest.raises(PlanError) as e:
        Plan.from_dict(d)
    assert "replicas[0].stages[0].tp_grid" in str(e.value) and needle in str(e.value)


def _err(plan, model=None) -> str:
    with pytest.raises(PlanError) as e:
        validate_plan(plan, model or _model())
    return str(e.value)


def test_grid_product_must_equal_the_stage_ranks():
    msg = _err(_plan((2, 2, 2)))
    assert "replicas[0].stages[0].tp_grid" in msg
    assert "gx*gy*gz = 8 must equal the stage's 4 ranks" in msg and "Fix:" in msg


@pytest.mark.parametrize("grid, model_kw, needle", [
    ((1, 4, 1), dict(num_attention_heads=2), "gy = 4 does not divide num_attention_heads=2"),
    ((1, 1, 4), dict(hidden_size=66, num_attention_heads=2), "gx*gz = 4 does not divide hidden_size=66"),
    ((1, 2, 2), dict(ffn_hidden_size=66), "gy*gz = 4 does not divide ffn_hidden_size=66"),
])
def test_grid_must_divide_hidden_ffn_and_heads(grid, model_kw, needle):
    msg = _err(_plan(grid), _model(**model_kw))
    assert "replicas[0].stages[0].tp_grid" in msg and needle in msg and "choose a grid whose" in msg


def test_tp_grid_refuses_gated_mlps():
    msg = _err(_plan((2, 2, 1)), _model(swiglu=True))
    assert "replicas[0].stages[0].tp_grid" in msg and "SwiGLU" in msg and 'remove "tp_grid"' in msg


@pytest.mark.parametrize("model_kw, needle", [
    (dict(normalization="RMSNorm"), "GPT-2's architecture only (got normalization='RMSNorm')"),
    (dict(position_embedding_type="rope"), "(got position_embedding_type='rope')"),
    (dict(qk_layernorm=True), "(got qk_layernorm=True)"),
    (dict(layernorm_zero_centered_gamma=True), "(got layernorm_zero_centered_gamma=True)"),
    (dict(hidden_dropout=0.1), "the 3D layers run without dropout"),
])
def test_tp_grid_refuses_what_the_3d_layers_do_not_build(model_kw, needle):
    """model/tp3d.py builds GPT-2's layer (LayerNorm, learned positions, biases) without dropout: any other
    architecture is refused when the plan is checked, not built silently as another model."""
    msg = _err(_plan((2, 2, 1)), _model(**model_kw))
    assert "replicas[0].stages[0].tp_grid" in msg and needle in msg, msg


def test_tp_grid_excludes_the_1d_overlap_flag():
    msg = _err(_plan((2, 2, 1), tp_comm_overlap=True))
    assert "replicas[0].stages[0].tp_comm_overlap" in msg and 'remove "tp_comm_overlap"' in msg


@pytest.mark.parametrize("plan_kw, stage_kw, needle", [
    ({"use_distributed_optimizer": True}, {}, "with the distributed optimizer's shards of 3D blocks"),
    ({"schedule": "interleaved", "virtual_pipeline_size": 2}, {}, "interleaved model chunks (virtual_pipeline_size 2)"),
    ({}, {"grid": (1, 1, 4)}, "micro_batch_size 2 not divisible by the grid's z = 4"),
])
def test_runtime_refuses_what_a_3d_stage_cannot_run_yet(plan_kw, stage_kw, needle):
    """HeteroTrainer builds 3D stages (model/tp3d_stage.py) but refuses, up front and before any
    process group is touched, the combinations not built yet, naming the stage, the reason and the fix."""
    import dataclasses

    from megatron_het.plan.validate import check_runtime_tp_grid
    from megatron_het.runtime.hetero_trainer import HeteroTrainer
    from megatron_het.train.config import TrainConfig

    check_runtime_tp_grid(_plan(None))  # 1D plans pass
    check_runtime_tp_grid(_plan((2, 2, 1)))  # a plain 3D stage runs
    check_runtime_tp_grid(_plan((2, 2, 1), recompute=True))  # and with recompute (parity: test_runtime_tp3d_parity)
    # and with sequence parallelism (the 3D stage runs without it; parity: test_runtime_tp3d_parity)
    check_runtime_tp_grid(dataclasses.replace(_plan((2, 2, 1)), sequence_parallel=True))
    # also beside a sequence-parallel 1D replica of the same layers (2 replicas of 2 micro-batches)
    one_d = tuple(StagePlan(island="fast", device_type="CPU", ranks=(6 + 2 * i, 7 + 2 * i), layers=(2 * i, 2 * i + 2))
                  for i in range(2))
    base = _plan((2, 2, 1))
    check_runtime_tp_grid(dataclasses.replace(base, sequence_parallel=True, replicas=(
        dataclasses.replace(base.replicas[0], num_micro_batches=2), ReplicaPlan(stages=one_d, num_micro_batches=2))))
    grid = stage_kw.pop("grid", (2, 2, 1))
    plan = _plan(grid, **stage_kw)
    plan = dataclasses.replace(plan, **plan_kw)
    with pytest.raises(PlanError) as e:
        HeteroTrainer(model=_model(), plan=plan, train=TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=1),
                      batch_fn=lambda *a: None)
    msg = str(e.value)
    assert "replicas[0].stages[0].tp_grid" in msg and needle in msg, msg
    assert 'remove "tp_grid"' in msg
