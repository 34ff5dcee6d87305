"""``predict --trace`` draws the schedule the runtime runs, timed by the model (#16 item 4)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_het.cli.predict import main
from megatron_het.cluster import load_cluster, load_model
from megatron_het.perf.predict import predict, replica_trace
from megatron_het.plan import Plan, uneven_chunk_layers
from megatron_het.schedule import build_schedule

CLUSTER, MODEL, PLAN = "examples/clusters/cpu-demo.yaml", "examples/models/tiny-cpu.yaml", "examples/plans/cpu-demo-hetero.json"


def _interleaved(tmp_path):
    base = Plan.load(PLAN)  # its two stages on a 6-layer model: 4 and 2 layers, chunks 2+2 and 1+1
    model = replace(load_model(MODEL), num_layers=6)
    chunks = uneven_chunk_layers([[2, 2], [1, 1]])
    r = base.replicas[0]
    stages = (replace(r.stages[0], layers=(0, 4), chunk_layers=chunks[0]),
              replace(r.stages[1], layers=(4, 6), chunk_layers=chunks[1]))
    plan = replace(base, schedule="interleaved", virtual_pipeline_size=2, replicas=(replace(r, stages=stages),))
    return plan, model


@pytest.mark.parametrize("schedule", ["interleaved", "zb-h1"])
def test_trace_is_the_runtime_schedule_and_prices_like_the_prediction(tmp_path, schedule):
    plan, model = _interleaved(tmp_path)
    if schedule == "zb-h1":
        plan = replace(plan, schedule="zb-h1", virtual_pipeline_size=1,
                       replicas=tuple(replace(r, stages=tuple(replace(s, chunk_layers=()) for s in r.stages))
                                      for r in plan.replicas))
    cluster = load_cluster(CLUSTER)
    pred = predict(plan, model, cluster)
    sim = replica_trace(plan, 0, model, cluster, pred)
    r = plan.replicas[0]
    # the runtime executes build_schedule(plan.schedule, p, m, v) (runtime/hetero_trainer.py): the same lists
    assert sim.schedule.actions == build_schedule(schedule, len(r.stages), r.num_micro_batches,
                                                  plan.virtual_pipeline_size).actions
    assert sim.iteration_time == pytest.approx(pred.replicas[0].pipeline_time_s, rel=1e-9)


def test_cli_trace_prints_a_grid_with_chunks(tmp_path, capsys):
    plan, model = _interleaved(tmp_path)
    plan.save(tmp_path / "plan.json")
    (tmp_path / "model.yaml").write_text(open(MODEL).read().replace("num_layers: 4", "num_layers: 6"))
    assert main(["--cluster", CLUSTER, "--model", str(tmp_path / "model.yaml"), "--plan", str(tmp_path / "plan.json"),
                 "--trace"]) == 0
    out = capsys.readouterr().out
    assert "replica 0: schedule interleaved, 2 chunks per stage, 8 micro-batches" in out
    grid = [line for line in out.splitlines() if line.startswith("stage ")]
    assert len(grid) == 2 and "F0.1" in grid[0] and "B7.1" in grid[1]


def test_output_layer_and_embedding_are_priced_on_their_own_chunk(tmp_path):
    """Interleaved: only the last stage's last chunk runs the output layer + loss and only stage 0's first
    chunk the embedding; the rest of a stage's time splits by layers (bench/schedules_gap.py measured the
    last chunk at 1.3x a layer share)."""
    from megatron_het.perf.predict import action_duration
    from megatron_het.schedule import Action

    plan, model = _interleaved(tmp_path)
    pred = predict(plan, model, load_cluster(CLUSTER))
    stages = pred.replicas[0].stages
    ef, eb, _, _ = stages[0].ends_s
    _, _, of, ob = stages[1].ends_s
    assert ef > 0 and of > 0 and ob > 0
    dur = action_duration(plan, plan.replicas[0], [s.forward_s for s in stages], [s.backward_s for s in stages],
                          ends=[s.ends_s for s in stages])
    f = [[dur(s, Action(kind="F", micro_batch=0, chunk=c)) for c in (0, 1)] for s in (0, 1)]
    b1 = [dur(1, Action(kind="B", micro_batch=0, chunk=c)) for c in (0, 1)]
    assert f[1][1] - f[1][0] == pytest.approx(of, rel=1e-9)  # the last chunk alone carries the output layer
    assert b1[1] - b1[0] == pytest.approx(ob, rel=1e-9)
    assert f[0][0] - f[0][1] == pytest.approx(ef, rel=1e-9)  # the first chunk alone carries the embedding
    assert sum(f[1]) == pytest.approx(stages[1].forward_s, rel=1e-9)  # nothing priced twice or lost
    assert sum(b1) == pytest.approx(stages[1].backward_s, rel=1e-9)


def test_zero_bubble_b_and_w_are_priced_from_the_measured_split(tmp_path):
    """A profile's measured split (Profile.backward_split) prices ZB-H1's B and W as those shares of the fused
    backward (the pipeline measured B at ~1.15x and W at 1.03-1.10x of half, bench/schedules_gap.py); without
    one, half each. The trace (predict --trace) prices them the same way."""
    from megatron_het.perf.predict import action_duration
    from megatron_het.perf.profile import Profile
    from megatron_het.schedule import Action

    plan, model = _interleaved(tmp_path)
    plan = replace(plan, schedule="zb-h1", virtual_pipeline_size=1,
                   replicas=tuple(replace(r, stages=tuple(replace(s, chunk_layers=()) for s in r.stages))
                                  for r in plan.replicas))
    cluster = load_cluster(CLUSTER)
    halves = predict(plan, model, cluster)
    profile = Profile(device="CPU", entries=(), method="test", backward_split=(0.6, 0.55))
    pred = predict(plan, model, cluster, profile=profile)
    stages = pred.replicas[0].stages
    assert [s.backward_split for s in stages] == [(0.6, 0.55)] * 2
    assert [s.backward_split for s in halves.replicas[0].stages] == [(0.5, 0.5)] * 2
    dur = action_duration(plan, plan.replicas[0], [s.forward_s for s in stages], [s.backward_s for s in stages],
                          ends=[s.ends_s for s in stages], split=[s.backward_split for s in stages])
    for s in (0, 1):
        assert dur(s, Action(kind="B", micro_batch=0)) == pytest.approx(0.6 * stages[s].backward_s, rel=1e-9)
        assert dur(s, Action(kind="W", micro_batch=0)) == pytest.approx(0.55 * stages[s].backward_s, rel=1e-9)
    assert pred.replicas[0].pipeline_time_s > halves.replicas[0].pipeline_time_s  # 15% more backward work
    assert replica_trace(plan, 0, model, cluster, pred).iteration_time == pytest.approx(
        pred.replicas[0].pipeline_time_s, rel=1e-9)


@pytest.mark.parametrize("schedule", ["interleaved", "1f1b"])
def test_call_overhead_is_charged_once_per_action(tmp_path, schedule):
    """A profile's measured per-call cost (Profile.call_overhead, the intercept of a chunk's time vs its
    layers; the entries, measured on stacks of n layers, hold 1/n of it per layer) is charged once per
    action: a chunk of l layers costs cf (1 - l/n) more than its layer share, whatever the schedule."""
    from megatron_het.perf.predict import action_duration
    from megatron_het.perf.profile import Profile
    from megatron_het.schedule import Action

    plan, model = _interleaved(tmp_path)
    if schedule == "1f1b":
        plan = replace(plan, schedule="1f1b", virtual_pipeline_size=1,
                       replicas=tuple(replace(r, stages=tuple(replace(s, chunk_layers=()) for s in r.stages))
                                      for r in plan.replicas))
    cluster = load_cluster(CLUSTER)
    cf, cb, n = 2e-5, 1e-5, 2  # below the analytic layer times these stages are priced from (entries=())
    bare = predict(plan, model, cluster, profile=Profile(device="CPU", entries=(), method="test"))
    pred = predict(plan, model, cluster, profile=Profile(device="CPU", entries=(), method="test",
                                                         call_overhead=(cf, cb), call_overhead_layers=n))
    v = plan.virtual_pipeline_size

    def durations(p):
        st = p.replicas[0].stages
        dur = action_duration(plan, plan.replicas[0], [s.forward_s for s in st], [s.backward_s for s in st],
                              ends=[s.ends_s for s in st], overhead=[s.call_overhead_s for s in st])
        return {(s, k, c): dur(s, Action(kind=k, micro_batch=0, chunk=c)) for s in (0, 1) for k in "FB"
                for c in range(v)}

    with_overhead, without = durations(pred), durations(bare)
    chunk_sizes = [[b - a for a, b in s.chunk_layers] if v > 1 else [s.num_layers] for s in plan.replicas[0].stages]
    for (s, kind, c), seconds in with_overhead.items():
        expected = (cf if kind == "F" else cb) * (1 - chunk_sizes[s][c] / n)
        assert seconds - without[(s, kind, c)] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert replica_trace(plan, 0, model, cluster, pred).iteration_time == pytest.approx(
        pred.replicas[0].pipeline_time_s, rel=1e-9)
