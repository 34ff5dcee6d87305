"""validate_plan: every rule, with messages that name the field, the numbers and the fix."""

from dataclasses import replace

import pytest

from megatron_het.cluster import cluster_from_dict, load_cluster, load_model, model_from_dict
from megatron_het.plan import (
    Plan,
    PlanError,
    ReplicaPlan,
    StagePlan,
    chunk_layers,
    homogeneous_plan,
    uneven_chunk_layers,
    validate_plan,
)

CLUSTER = "examples/clusters/cpu-demo.yaml"
MODEL = "examples/models/tiny-cpu.yaml"


def _model(**kw):
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=512)
    base.update(kw)
    return model_from_dict(base)


def _stage(ranks, layers, island="fast", **kw):
    return StagePlan(island=island, device_type="CPU", ranks=tuple(ranks), layers=tuple(layers), **kw)


def _plan(*replicas, mbs=2, gbs=None, **kw):
    reps = tuple(ReplicaPlan(stages=tuple(stages), num_micro_batches=n) for stages, n in replicas)
    if gbs is None:
        gbs = mbs * sum(r.num_micro_batches for r in reps)
    return Plan(replicas=reps, micro_batch_size=mbs, global_batch_size=gbs, **kw)


def _err(plan, model=None, cluster=None, **kw) -> str:
    with pytest.raises(PlanError) as e:
        validate_plan(plan, model or _model(), cluster, **kw)
    return str(e.value)


@pytest.mark.parametrize("path", ["examples/plans/cpu-demo-hetero.json", "examples/plans/cpu-demo-2replicas.json"])
def test_examples_are_valid_on_cpu_demo(path):
    validate_plan(Plan.load(path), load_model(MODEL), load_cluster(CLUSTER))


def test_rank_used_twice():
    plan = _plan(([_stage([0, 1], [0, 2]), _stage([1, 2], [2, 4], "slow")], 4))
    msg = _err(plan)
    assert msg.startswith("replicas[0].stages[1].ranks: rank 1 is used twice (also in replicas[0].stages[0].ranks)")
    assert "(got [1, 2])" in msg and "Fix:" in msg


def test_ranks_not_contiguous():
    plan = _plan(([_stage([0, 1], [0, 2]), _stage([2, 5], [2, 4], "slow")], 4))
    msg = _err(plan)
    assert "replicas[0].stages[1].ranks: ranks must be exactly 0..3 for the 4 ranks placed" in msg
    assert "rank 5 is out of range and [3] are unused" in msg


def test_layers_missing_overlapping_and_short():
    gap = _plan(([_stage([0], [0, 1]), _stage([1], [2, 4])], 2))
    assert "replicas[0].stages[1].layers: starts at layer 2 but the previous stage stopped at 1 (layers missing)" in _err(gap)
    overlap = _plan(([_stage([0], [0, 3]), _stage([1], [2, 4])], 2))
    assert "(layers overlap)" in _err(overlap) and "start this one at 3" in _err(overlap)
    late_start = _plan(([_stage([0], [1, 4])], 2))
    assert "the first stage must start at layer 0, not 1" in _err(late_start)
    short = _plan(([_stage([0], [0, 3])], 2))
    assert "stops at layer 3 but the model has num_layers=4" in _err(short)


def test_zero_layer_stage_forbidden():
    plan = _plan(([_stage([0], [0, 4]), _stage([1], [4, 4])], 2))
    msg = _err(plan)
    assert msg.startswith("replicas[0].stages[1].layers: a stage needs at least 1 layer")
    assert "got 0 layers" in msg


def test_second_replica_checked_too():
    plan = _plan(([_stage([0], [0, 4])], 2), ([_stage([1], [0, 2]), _stage([2], [3, 4])], 2))
    assert _err(plan).startswith("replicas[1].stages[1].layers:")


def test_tp_must_divide_heads_query_groups_ffn():
    plan = _plan(([_stage([0, 1, 2], [0, 4])], 2))
    msg = _err(plan)
    assert "tensor-parallel size 3 (number of ranks) does not divide num_attention_heads=4" in msg
    assert "one of [1, 2, 4]" in msg
    gqa = _model(num_attention_heads=8, num_query_groups=2)
    plan4 = _plan(([_stage([0, 1, 2, 3], [0, 4])], 2))
    assert "does not divide num_query_groups=2" in _err(plan4, gqa)
    ffn = _model(ffn_hidden_size=254)
    assert "does not divide ffn_hidden_size=254" in _err(plan4, ffn)
    # vocab_size is not checked: Megatron pads it to a multiple of 128 * TP.
    validate_plan(_plan(([_stage([0, 1, 2, 3], [0, 4])], 2)), _model(vocab_size=501))


def test_sequence_parallel_needs_tp_dividing_seq_length():
    plan = _plan(([_stage([0, 1, 2, 3], [0, 4])], 2), sequence_parallel=True)
    assert "sequence_parallel needs TP size 4 to divide seq_length=62" in _err(plan, _model(seq_length=62))


def test_global_batch_mismatch_shows_both_numbers():
    plan = _plan(([_stage([0], [0, 4])], 6), ([_stage([1], [0, 4])], 1), mbs=2, gbs=16)
    msg = _err(plan)
    assert msg.startswith("global_batch_size: must equal micro_batch_size * sum(num_micro_batches) = 2 * 7 = 14, but is 16")
    assert "Fix: set global_batch_size to 14" in msg


def test_num_micro_batches_at_least_one():
    plan = _plan(([_stage([0], [0, 4])], 8), ([_stage([1], [0, 4])], 0))
    msg = _err(plan)
    assert msg.startswith("replicas[1].num_micro_batches: every replica needs at least 1 micro-batch")
    assert "(got 0)" in msg


def test_schedule_name_and_virtual_pipeline():
    base = Plan.load("examples/plans/cpu-demo-hetero.json")
    msg = _err(replace(base, schedule="1F1B"))
    assert msg.startswith("schedule: unknown schedule name (got '1F1B')") and "1f1b, gpipe, interleaved, zb-h1" in msg
    assert "needs at least 2 model chunks" in _err(replace(base, schedule="interleaved"))
    assert "runs 1 model chunk per stage, not 2" in _err(replace(base, virtual_pipeline_size=2))
    # Stage 1 has 1 layer: it cannot hold 2 chunks.
    msg = _err(replace(base, schedule="interleaved", virtual_pipeline_size=2))
    assert "replicas[0].stages[0].layers: 3 layers do not split into virtual_pipeline_size=2" in msg
    ok = homogeneous_plan(tp=1, pp=2, dp=1, num_layers=4, micro_batch_size=1, global_batch_size=4)
    validate_plan(replace(ok, schedule="interleaved", virtual_pipeline_size=2), _model())
    odd = homogeneous_plan(tp=1, pp=2, dp=1, num_layers=4, micro_batch_size=1, global_batch_size=3)
    assert "needs a multiple of the replica's 2 stages" in _err(replace(odd, schedule="interleaved", virtual_pipeline_size=2))



def test_runtime_refuses_what_it_does_not_implement_naming_it():
    """#16: a schedule / virtual size the runtime cannot run is refused by validation, never run as another."""
    ok = homogeneous_plan(tp=1, pp=2, dp=1, num_layers=4, micro_batch_size=1, global_batch_size=4)
    for name in ("1f1b", "gpipe", "zb-h1"):
        msg = _err(replace(ok, schedule=name, virtual_pipeline_size=2))
        assert f"virtual_pipeline_size: schedule '{name}' runs 1 model chunk per stage, not 2" in msg
    one = homogeneous_plan(tp=1, pp=1, dp=1, num_layers=4, micro_batch_size=1, global_batch_size=4)
    msg = _err(replace(one, schedule="interleaved", virtual_pipeline_size=2))
    assert "replicas[0].stages: the runtime runs interleaved (virtual_pipeline_size=2) only with >= 2 stages" in msg


def _chunked(chunks0, chunks1, layers0=(0, 4), layers1=(4, 6)):
    stages = (replace(_stage([0], list(layers0)), layers=tuple(layers0), chunk_layers=tuple(chunks0)),
              replace(_stage([1], list(layers1)), layers=tuple(layers1), chunk_layers=tuple(chunks1)))
    return Plan(replicas=(ReplicaPlan(stages=stages, num_micro_batches=2),), micro_batch_size=1,
                global_batch_size=2, schedule="interleaved", virtual_pipeline_size=2)


def test_uneven_chunk_layers_in_virtual_stage_order():
    model = replace(_model(), num_layers=6)
    good = _chunked([(0, 2), (3, 5)], [(2, 3), (5, 6)])
    validate_plan(good, model)
    assert chunk_layers(good.replicas[0], 2) == (((0, 2), (3, 5)), ((2, 3), (5, 6)))
    assert uneven_chunk_layers([[2, 2], [1, 1]]) == (((0, 2), (3, 5)), ((2, 3), (5, 6)))
    assert Plan.from_dict(good.to_dict()) == good  # JSON round trip keeps the chunks
    msg = _err(_chunked([(0, 2), (2, 4)], [(4, 5), (5, 6)]), model=model)
    assert "replicas[0].stages[1].chunk_layers[0]: virtual stage 1 (chunk 0 of stage 1) must start at layer 2" in msg
    msg = _err(_chunked([(0, 2), (3, 5)], [(2, 3)]), model=model)
    assert "1 chunks listed, virtual_pipeline_size is 2" in msg
    msg = _err(_chunked([(0, 2), (3, 5)], [(2, 3), (5, 6)], layers0=(0, 3), layers1=(3, 6)), model=model)
    assert "the chunks hold 4 layers, the stage's layers [0, 3] say 3" in msg
    msg = _err(replace(good, schedule="1f1b", virtual_pipeline_size=1), model=model)
    assert "chunk_layers: model chunks need schedule 'interleaved', the plan has '1f1b'" in msg

def test_cluster_island_device_and_capacity():
    cluster = load_cluster(CLUSTER)
    plan = _plan(([_stage([0, 1], [0, 3]), _stage([2, 3], [3, 4], "medium")], 8))
    msg = _err(plan, cluster=cluster)
    assert msg.startswith("replicas[0].stages[1].island: no island of that name in the cluster")
    assert "use one of fast, slow" in msg
    wrong_dev = _plan(([StagePlan(island="fast", device_type="A100-80GB", ranks=(0, 1), layers=(0, 4))], 8))
    msg = _err(wrong_dev, cluster=cluster)
    assert "replicas[0].stages[0].device_type: island 'fast' has device type 'CPU'" in msg
    assert 'set "device_type": "CPU"' in msg
    crowded = _plan(([_stage([0, 1], [0, 2]), _stage([2, 3], [2, 4])], 8))
    msg = _err(crowded, cluster=cluster)
    assert "places 4 ranks on island 'fast', which has only 2 GPUs" in msg


def test_cluster_with_real_device_names():
    cluster = cluster_from_dict({
        "islands": [{"name": "a100", "device": "A100-80GB", "nodes": 1, "gpus_per_node": 4}],
    })
    plan = _plan(([StagePlan(island="a100", device_type="A100-80GB", ranks=(0, 1, 2, 3), layers=(0, 4))], 2))
    validate_plan(plan, _model(), cluster)


def test_memory_check_hook_is_called_last_with_arguments():
    seen = []
    model, cluster = load_model(MODEL), load_cluster(CLUSTER)
    plan = Plan.load("examples/plans/cpu-demo-hetero.json")

    def check(p, m, c):
        seen.append((p, m, c))
        raise PlanError(field="replicas[0].stages[0]", value="9.5 GiB",
                        problem="needs 9.5 GiB, device has 8.0 GiB", fix="enable recompute")

    with pytest.raises(PlanError, match="needs 9.5 GiB, device has 8.0 GiB"):
        validate_plan(plan, model, cluster, memory_check=check)
    assert seen == [(plan, model, cluster)]
    # Not called when an earlier check already failed.
    seen.clear()
    with pytest.raises(PlanError, match="global_batch_size"):
        validate_plan(replace(plan, global_batch_size=15), model, cluster, memory_check=check)
    assert seen == []
