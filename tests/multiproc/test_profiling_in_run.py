"""profiling.in_run.profile_in_rank inside a 2-rank gloo world, as bench/schedules.py's ranks call it."""

import pytest

from megatron_het.cluster import ModelSpec
from megatron_het.perf.profile import profile_from_dict
from megatron_het.platform.local_launch import run_local
from megatron_het.profiling.in_run import median_profile

from workers.profiling_workers import in_run_profile_worker

pytestmark = pytest.mark.multiproc

MODEL = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1)


def test_every_rank_profiles_on_its_emulated_device_and_leaves_no_groups():
    """Rank 1 emulates a device 5x slower than the host: it waits 4x every timed section (its wall time holds
    at least 4x its timed sections), rank 0 none; megatron-core's groups for the measured layers are
    destroyed; the ranks' profiles combine into one."""
    got = run_local(2, in_run_profile_worker, (MODEL, (1.0, 5.0)), timeout_s=600)
    profiles = [profile_from_dict(p) for p, *_ in got]
    for _, before, after, _, _ in got:
        assert after == before  # only the world: the measurement's groups are gone
    for p in profiles:
        assert p.entries[0].forward_s > 0 and p.optimizer_s_per_parameter > 0
        assert "each of its 2 ranks at once" in p.method
    assert "4x each timed section waited" in profiles[1].method and "waited" not in profiles[0].method
    timed = [3 * (p.entries[0].forward_s + p.entries[0].backward_s) * 2 for p in profiles]  # 3 reps, 2 layers
    assert got[1][3] >= 4 * timed[1]  # rank 1's wall time holds its device's waits
    combined = median_profile(profiles, what="ranks")
    assert combined.entries[0].forward_s == pytest.approx(
        (profiles[0].entries[0].forward_s + profiles[1].entries[0].forward_s) / 2)
