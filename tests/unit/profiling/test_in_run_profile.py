"""profiling.in_run: a profile measured by a run's ranks on their emulated devices, combined by median."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import megatron_het.profiling.layers as layers_mod
from megatron_het.cluster import ModelSpec
from megatron_het.perf.profile import MeasuredLink, PartEntry, Profile, ProfileEntry
from megatron_het.profiling.in_run import median_profile, profile_in_rank

MODEL = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1)


def _profile(fwd: float, bwd: float, *, mbs: int = 2, split=(0.6, 0.5), overhead=(1e-3, 2e-3), opt=1e-9) -> Profile:
    entry = ProfileEntry(hidden_size=64, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=256, swiglu=False,
                         seq_length=16, micro_batch_size=mbs, tp=1, forward_s=fwd, backward_s=bwd,
                         peak_memory_bytes=1000)
    part = PartEntry(part="output", hidden_size=64, vocab_size=128, seq_length=16, micro_batch_size=mbs, tp=1,
                     forward_s=fwd / 2, backward_s=bwd / 2)
    return Profile(device="CPU", entries=(entry,), parts=(part,), method="m", machine={},
                   optimizer_s_per_parameter=opt, optimizer_method="o", backward_split=split,
                   backward_split_method="s", call_overhead=overhead, call_overhead_layers=2, call_overhead_method="c")


def test_median_profile_takes_every_measured_figure_as_the_median():
    profiles = [_profile(1.0, 10.0, split=(0.5, 0.9), overhead=(3e-3, 1e-3), opt=3e-9),
                _profile(5.0, 20.0, split=(0.7, 0.5), overhead=(1e-3, 2e-3), opt=1e-9),
                _profile(2.0, 90.0, split=(0.6, 0.6), overhead=(2e-3, 9e-3), opt=2e-9)]
    got = median_profile(profiles, what="rank profiles")
    (e,) = got.entries
    assert (e.forward_s, e.backward_s) == (2.0, 20.0)
    assert (got.parts[0].forward_s, got.parts[0].backward_s) == (1.0, 10.0)
    assert got.backward_split == (0.6, 0.6) and got.call_overhead == (2e-3, 2e-3)
    assert got.optimizer_s_per_parameter == 2e-9 and got.call_overhead_layers == 2
    assert got.method.endswith("median over 3 rank profiles") and "median over 3" in got.backward_split_method
    assert median_profile(profiles[:1]).entries == profiles[0].entries


def test_median_profile_refuses_profiles_measured_differently():
    with pytest.raises(ValueError, match="at least one"):
        median_profile([])
    with pytest.raises(ValueError, match="layer entries"):
        median_profile([_profile(1.0, 2.0), _profile(1.0, 2.0, mbs=4)])
    with pytest.raises(ValueError, match="options"):
        median_profile([_profile(1.0, 2.0), _profile(1.0, 2.0, split=None)])
    link = MeasuredLink(ranks=2, latency_us=10.0, bandwidth_gbps=1.0, method="fit")
    with pytest.raises(ValueError, match="measured link"):
        median_profile([_profile(1.0, 2.0), replace(_profile(1.0, 2.0), link=link)])


def test_idle_factor_waits_after_every_timed_section(monkeypatch):
    """profile_layers(idle_factor=k): after each timed section (forward, backward, optimizer step) the process
    waits k x its measured seconds, as an emulated device of slowdown k + 1; undone afterwards."""
    ticks, sleeps = [0.0], []

    def clock():  # each reading 0.5 s later: every timed section measures 0.5 s
        ticks[0] += 0.5
        return ticks[0]

    monkeypatch.setitem(layers_mod.CLOCKS, "thread", clock)
    monkeypatch.setattr(layers_mod.time, "sleep", sleeps.append)
    profile = layers_mod.profile_layers(MODEL, num_layers=2, micro_batch_sizes=[1], device="CPU", warmup=1, repeats=2,
                                        dtype=torch.float32, implementation="torch", optimizer=True, clock="thread",
                                        idle_factor=3.0, barrier=False)
    # 3 forward + 3 backward of the layers, 3 optimizer steps: each waited 3 x 0.5 s
    assert sleeps == [1.5] * 9
    assert profile.entries[0].forward_s == 0.25  # the waits are not part of the times (2 layers)
    assert "3x each timed section waited" in profile.method
    assert layers_mod._TIMING.idle_factor == 0.0 and layers_mod._TIMING.barrier is True
    sleeps.clear()
    layers_mod.profile_layers(MODEL, num_layers=2, micro_batch_sizes=[1], device="CPU", warmup=1, repeats=2,
                              dtype=torch.float32, implementation="torch", clock="thread")
    assert sleeps == []
    with pytest.raises(ValueError, match="idle_factor"):
        layers_mod.profile_layers(MODEL, num_layers=2, micro_batch_sizes=[1], device="CPU", warmup=0, repeats=1,
                                  dtype=torch.float32, implementation="torch", idle_factor=-1.0)


def test_profile_in_rank_refuses_outside_a_run_and_faster_than_the_host():
    options = dict(num_layers=2, micro_batch_sizes=[1], device="CPU", warmup=0, repeats=1)
    with pytest.raises(ValueError, match="slowdown"):
        profile_in_rank(MODEL, slowdown=0.5, **options)
    with pytest.raises(ValueError, match="init_process_group"):
        profile_in_rank(MODEL, slowdown=2.0, **options)


def test_emulated_profile_is_one_median_per_island_each_rank_waiting_its_own_share(monkeypatch):
    """profile_emulated: rank i waits slowdown_i - 1 after each section, no barrier; one profile per
    island (Profile.island), the median over that island's ranks only."""
    import megatron_het.platform.local_launch as local_launch

    calls = []

    def fake_run_local(world, fn, args, timeout_s):
        model, kwargs, factors = args
        calls.append((world, list(factors)))
        return [_profile(t, 2 * t) for t in (1.0, 3.0, 10.0, 30.0, 50.0)]

    monkeypatch.setattr(local_launch, "run_local", fake_run_local)
    got = layers_mod.profile_emulated(MODEL, islands=["fast", "fast", "slow", "slow", "slow"],
                                      slowdowns=[4.0, 4.0, 8.0, 8.0, 8.0], num_layers=1, micro_batch_sizes=[2])
    assert calls == [(5, [3.0, 3.0, 7.0, 7.0, 7.0])]
    assert [p.island for p in got] == ["fast", "slow"]
    assert got[0].entries[0].forward_s == 2.0 and got[1].entries[0].forward_s == 30.0  # medians of 1,3 and 10,30,50
    assert got[1].entries[0].backward_s == 60.0 and "island 'slow'" in got[1].method
    # each process stands for its rank: the idle factor and no barrier reach profile_layers
    seen = []
    monkeypatch.setattr(layers_mod, "profile_layers", lambda model, **kw: seen.append(kw) or _profile(1.0, 1.0))
    layers_mod._concurrent_rank(2, 5, MODEL, {"clock": "thread"}, [3.0, 3.0, 7.0, 7.0, 7.0])
    assert seen == [{"clock": "thread", "idle_factor": 7.0, "barrier": False}]
    with pytest.raises(ValueError, match="one island and one slowdown >= 1 per rank"):
        layers_mod.profile_emulated(MODEL, islands=["fast"], slowdowns=[0.5], num_layers=1, micro_batch_sizes=[2])
