"""planner.block_recompute.least_recompute_layers and its use by plan_cluster: a stage short of memory
recomputes the least number of each chunk's first layers that fits (Megatron's block method), priced
against perf.memory.stage_memory directly and against the full-recompute plan."""

from dataclasses import replace

import pytest

from megatron_het.cluster import cluster_from_dict, load_model
from megatron_het.perf import predict
from megatron_het.perf.memory import device_capacity_bytes, microbatches_in_flight, stage_memory
from megatron_het.plan import homogeneous_plan
from megatron_het.planner import plan_cluster
from megatron_het.planner.block_recompute import least_recompute_layers

MODEL = load_model("examples/models/llama2-13b.yaml")
CLUSTER = cluster_from_dict({"islands": [{"name": "a", "device": "A100-40GB", "nodes": 1, "gpus_per_node": 8}]})
CAPACITY = device_capacity_bytes(CLUSTER.island("a").device)


def _plan(*, mbs: int, pp: int, plain: tuple[int, ...] = ()):
    """TP x PP = 8 on the 40 GB island, every stage but ``plain`` recomputing all its layers."""
    plan = homogeneous_plan(tp=8 // pp, pp=pp, dp=1, num_layers=MODEL.num_layers, micro_batch_size=mbs,
                            global_batch_size=64, island="a", device_type="A100-40GB")
    stages = tuple(replace(s, recompute=i not in plain) for i, s in enumerate(plan.replicas[0].stages))
    return replace(plan, replicas=(replace(plan.replicas[0], stages=stages),))


def _fits(plan, i: int, n: int) -> bool:
    r = plan.replicas[0]
    st, p = r.stages[i], len(r.stages)
    mem = stage_memory(MODEL, num_layers=st.num_layers, is_first=i == 0, is_last=i == p - 1,
                       micro_batch_size=plan.micro_batch_size,
                       microbatches_in_flight=microbatches_in_flight(stage=i, pipeline_size=p,
                                                                     num_microbatches=r.num_micro_batches),
                       tp=st.tp, dp=1, recompute="full", distributed_optimizer=plan.use_distributed_optimizer,
                       flash_attention=True, recompute_num_layers=n)
    return mem.total_bytes <= CAPACITY


def test_each_stage_gets_the_least_count_that_fits_and_plain_stages_are_untouched():
    plan = _plan(mbs=2, pp=8, plain=(7,))
    trimmed = least_recompute_layers(plan, MODEL, CLUSTER)
    counts = [st.recompute_num_layers for st in trimmed.replicas[0].stages]
    assert trimmed.replicas[0].stages[7] == plan.replicas[0].stages[7]  # no recompute: untouched
    assert any(n >= 2 for n in counts) and 0 in counts[:7]
    for i, (st, n) in enumerate(zip(trimmed.replicas[0].stages[:7], counts)):
        assert st.recompute
        if n:
            assert 0 < n < st.num_layers and _fits(plan, i, n)
            assert all(not _fits(plan, i, k) for k in range(1, n))  # nothing less fits
        else:  # every layer recomputes: no smaller count fits
            assert all(not _fits(plan, i, k) for k in range(1, st.num_layers))
    stages = predict(trimmed, MODEL, CLUSTER).replicas[0].stages  # the same memory as the prediction's
    assert [s.fits for s in stages[:7]] == [bool(n) or _fits(plan, i, 0) for i, n in enumerate(counts[:7])]


def test_a_count_equal_to_every_layer_stays_zero():
    plan = _plan(mbs=2, pp=8)
    st = least_recompute_layers(plan, MODEL, CLUSTER).replicas[0].stages[0]
    assert st.recompute and st.recompute_num_layers == 0
    assert _fits(plan, 0, st.num_layers) and not _fits(plan, 0, st.num_layers - 1)


def test_selective_recomputation_is_left_alone():
    plan = _plan(mbs=2, pp=4)
    assert least_recompute_layers(plan, MODEL, CLUSTER, recompute_mode="selective") is plan
    assert least_recompute_layers(plan, MODEL, CLUSTER, recompute_mode="full") != plan


def test_planner_gives_a_tight_stage_block_recomputation_and_it_is_faster_than_full():
    best = plan_cluster(MODEL, CLUSTER, global_batch_size=64).best
    partial = [st for r in best.replicas for st in r.stages if st.recompute_num_layers]
    assert partial and all(0 < st.recompute_num_layers < st.num_layers for st in partial)
    pred = predict(best, MODEL, CLUSTER)
    assert pred.fits and best.predicted["iteration_time_s"] == pytest.approx(pred.iteration_time_s)
    full = replace(best, replicas=tuple(replace(r, stages=tuple(replace(st, recompute_num_layers=0) for st in r.stages))
                                        for r in best.replicas))
    assert pred.iteration_time_s < predict(full, MODEL, CLUSTER).iteration_time_s


def test_printed_layouts_say_how_many_layers_recompute():
    """tools/plan.py's grouped lines: "RC" every layer, "RC2" the first 2 of each chunk, nothing when none."""
    from megatron_het.planner.explain import describe_plan
    from megatron_het.planner.summary import recompute_tag, summarize_plan

    plan = _plan(mbs=2, pp=8, plain=(7,))
    trimmed = least_recompute_layers(plan, MODEL, CLUSTER)
    stages = trimmed.replicas[0].stages
    tags = [recompute_tag(st) for st in stages]
    assert tags[7] == "" and all(t == (f" RC{st.recompute_num_layers}" if st.recompute_num_layers else " RC")
                                 for t, st in zip(tags[:7], stages[:7]))
    assert any(t.startswith(" RC") and t != " RC" for t in tags)
    text = describe_plan(trimmed)
    for st, t in zip(stages, tags):
        assert f"L{st.layers[0]}-{st.layers[1] - 1}{t}{' ' if st is not stages[-1] else ']'}" in text
    assert any(f"RC{st.recompute_num_layers}" in "\n".join(summarize_plan(trimmed)) for st in stages if st.recompute_num_layers)


def test_interleaved_stages_of_equal_chunks_are_trimmed_per_chunk_and_uneven_ones_left_alone():
    from megatron_het.planner.schedule_choice import schedule_variants

    inter = schedule_variants(_plan(mbs=1, pp=4))["interleaved v=2"]
    assert inter.virtual_pipeline_size == 2 and all(st.chunk_layers for st in inter.replicas[0].stages)
    r = inter.replicas[0]
    p, v = len(r.stages), 2

    def fits(i: int, n: int) -> bool:
        st = r.stages[i]
        mem = stage_memory(MODEL, num_layers=st.num_layers, is_first=i == 0, is_last=i == p - 1, micro_batch_size=1,
                           microbatches_in_flight=microbatches_in_flight(stage=i, pipeline_size=p, virtual_stages=v,
                                                                         num_microbatches=r.num_micro_batches),
                           tp=st.tp, dp=1, recompute="full", distributed_optimizer=False, flash_attention=True,
                           virtual_stages=v, recompute_num_layers=n)
        return mem.total_bytes <= CAPACITY

    counts = [st.recompute_num_layers for st in least_recompute_layers(inter, MODEL, CLUSTER).replicas[0].stages]
    assert any(counts), counts
    for i, n in enumerate(counts):
        chunk = r.stages[i].num_layers // v
        if n:  # the least count of each chunk's first layers that fits
            assert 0 < n < chunk and fits(i, n) and not any(fits(i, k) for k in range(1, n))
        else:
            assert not any(fits(i, k) for k in range(1, chunk))
    # uneven chunks within a stage: stage_memory prices equal chunks only, so the stage is not trimmed
    assert counts[0]  # stage 0 is trimmed when its chunks are equal ...
    (c0, _), (c1, _) = r.stages[0].chunk_layers
    uneven = replace(inter, replicas=(replace(r, stages=(replace(r.stages[0], chunk_layers=((c0, c0 + 3), (c1, c1 + 7))),)
                                              + r.stages[1:]),))
    assert least_recompute_layers(uneven, MODEL, CLUSTER).replicas[0].stages[0].recompute_num_layers == 0  # ... not here
