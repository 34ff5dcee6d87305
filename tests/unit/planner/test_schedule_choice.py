"""The planner prices every schedule the runtime runs for the chosen layout and says which it took (#16)."""

from dataclasses import replace

import pytest

from megatron_het.cluster import load_cluster, load_model
from megatron_het.plan import Plan, ReplicaPlan, StagePlan, validate_plan
from megatron_het.planner import plan_cluster
from megatron_het.planner.schedule_choice import choose_schedule, schedule_variants

TINY = load_model("examples/models/tiny-cpu.yaml")


def _plan(layers=((0, 3), (3, 4)), m=4) -> Plan:
    stages = tuple(StagePlan(island="fast", device_type="CPU", ranks=(i,), layers=lr) for i, lr in enumerate(layers))
    return Plan(replicas=(ReplicaPlan(stages=stages, num_micro_batches=m),), micro_batch_size=1, global_batch_size=m)


def test_variants_split_each_stage_into_uneven_chunks_or_say_why_not():
    v = schedule_variants(_plan(layers=((0, 2), (2, 8)), m=4))
    inter = v["interleaved v=2"]
    assert inter.schedule == "interleaved" and inter.virtual_pipeline_size == 2
    assert [st.chunk_layers for st in inter.replicas[0].stages] == [((0, 1), (4, 5)), ((1, 4), (5, 8))]
    validate_plan(inter, replace(TINY, num_layers=8))
    assert v["zb-h1"].schedule == "zb-h1"
    assert schedule_variants(_plan(m=3))["interleaved v=2"] == ("a replica's 3 micro-batches are not a multiple "
                                                                "of its 2 stages")
    assert schedule_variants(_plan())["interleaved v=2"] == "a stage's 3 layers do not split into 2 equal chunks"


class _Pred:
    def __init__(self, t, bubble=0.1, fits=True):
        self.iteration_time_s, self.fits, self.memory_gib_per_rank_max = t, fits, 1.0
        self.replicas = (type("R", (), {"bubble_fraction": bubble})(),)

    def to_json_dict(self):
        return {"iteration_time_s": self.iteration_time_s}


@pytest.mark.parametrize(("times", "chosen"), [({"zb-h1": 0.8, "interleaved": 0.9}, "zb-h1"),
                                                ({"zb-h1": 1.0, "interleaved": 1.2}, "1f1b"),
                                                ({"zb-h1": 0.95, "interleaved": 0.7}, "interleaved")])
def test_fastest_runnable_schedule_wins_and_the_sentence_names_the_others(times, chosen):
    model = replace(TINY, num_layers=8)
    plan = _plan(layers=((0, 4), (4, 8)), m=4)
    (got, pred), text = choose_schedule((plan, _Pred(1.0)), model, None,
                                        predict_plan=lambda p: _Pred(times[p.schedule]))
    assert got.schedule == chosen and text.startswith(f"Schedule: {chosen}")
    if chosen != "1f1b":  # a variant carries its own prediction (the given plan keeps its own)
        assert got.predicted == {"iteration_time_s": pred.iteration_time_s}
    for other in {"1f1b", "zb-h1", "interleaved v=2"} - {chosen, "interleaved v=2" if chosen == "interleaved" else ""}:
        assert other in text


def test_a_variant_that_does_not_fit_memory_is_refused_with_the_reason():
    plan = _plan(layers=((0, 4), (4, 8)), m=4)
    (got, _), text = choose_schedule((plan, _Pred(1.0)), replace(TINY, num_layers=8), None,
                                     predict_plan=lambda p: _Pred(0.5, fits=p.schedule != "zb-h1"))
    assert got.schedule == "interleaved" and "zb-h1 not possible: predicted memory 1.0 GiB exceeds a device" in text


def test_planner_result_says_which_schedule_and_runs_it():
    cluster = load_cluster("examples/clusters/cpu-demo.yaml")
    result = plan_cluster(TINY, cluster, global_batch_size=16)
    line = next(x for x in result.explanation.splitlines() if x.startswith("Schedule: "))
    assert line.startswith(f"Schedule: {result.best.schedule if result.best.virtual_pipeline_size == 1 else 'interleaved'}")
    validate_plan(result.best, TINY, cluster)
    assert result.best.predicted["iteration_time_s"] == pytest.approx(result.candidates[0][1].iteration_time_s)


def test_every_schedule_is_trimmed_before_they_are_compared():
    """Under full recomputation 1F1B is fastest, but interleaving, trimmed to the least block
    recomputation, beats 1F1B trimmed: the refined schedules are compared, not the untrimmed ones
    (trimming only the untrimmed winner kept 1F1B)."""
    plan = _plan(layers=((0, 4), (4, 8)), m=4)
    full = {"1f1b": 1.0, "zb-h1": 1.05, "interleaved": 1.1}
    trimmed = {"1f1b": 0.95, "zb-h1": 1.0, "interleaved": 0.8}
    seen = []

    def refine(priced):
        p, pred = priced
        seen.append(p.schedule)
        return replace(p, predicted={"iteration_time_s": trimmed[p.schedule]}), _Pred(trimmed[p.schedule])

    (got, pred), text = choose_schedule((plan, _Pred(full["1f1b"])), replace(TINY, num_layers=8), None,
                                        predict_plan=lambda p: _Pred(full[p.schedule]), refine=refine)
    assert sorted(seen) == ["1f1b", "interleaved", "zb-h1"]
    assert got.schedule == "interleaved" and pred.iteration_time_s == 0.8
    assert text.startswith("Schedule: interleaved v=2, predicted 0.8 s/iteration")
    assert "Block recomputation (the least that fits) instead of full: predicted 0.8 s/iteration (1.1 s" in text
    # without a gain from trimming the sentence says nothing about it
    _, plain = choose_schedule((plan, _Pred(1.0)), replace(TINY, num_layers=8), None,
                               predict_plan=lambda p: _Pred(full[p.schedule]), refine=lambda x: x)
    assert plain.startswith("Schedule: 1f1b") and "Block recomputation" not in plain
