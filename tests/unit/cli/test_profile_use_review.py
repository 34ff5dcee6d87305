"""--profile was silently ignored (a new-user review): profile_host.py recorded a misspelt device name,
and plan.py / predict.py dropped a profile of another device or layer shape without a word."""

from __future__ import annotations

import pytest

from megatron_het.cli import plan as plan_cli
from megatron_het.cli import predict, profile_host
from megatron_het.perf.profile import Profile, ProfileEntry, save_profile

from support.paths import EXAMPLES

CPU_DEMO = str(EXAMPLES / "clusters" / "cpu-demo.yaml")
TINY = str(EXAMPLES / "models" / "tiny-cpu.yaml")
DEMO_PLAN = str(EXAMPLES / "plans" / "cpu-demo-hetero.json")


def _profile(path, *, device="CPU", hidden_size=64, heads=4):
    entry = ProfileEntry(hidden_size=hidden_size, num_attention_heads=heads, num_query_groups=heads,
                         ffn_hidden_size=4 * hidden_size, swiglu=False, seq_length=64, micro_batch_size=2, tp=1,
                         forward_s=1e-3, backward_s=2e-3, peak_memory_bytes=1 << 20)
    save_profile(Profile(device=device, entries=(entry,), method="test"), path)
    return str(path)


@pytest.mark.parametrize("device", ["A100-80G", "cpu-typo"])
def test_profile_host_refuses_an_unknown_device_with_a_suggestion(tmp_path, capsys, device):
    rc = profile_host.main(["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
                            "--device", device, "--output", str(tmp_path / "p.json")])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--device" in err and "Fix: " in err
    assert ("did you mean 'A100-80GB'" in err) if device == "A100-80G" else ("CPU" in err)
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("tool", ["plan", "predict"])
def test_unused_profiles_are_named_on_stderr(tmp_path, capsys, tool):
    good = _profile(tmp_path / "good.json")
    other_device = _profile(tmp_path / "a100.json", device="A100-80GB")
    other_shape = _profile(tmp_path / "wide.json", hidden_size=128)
    profiles = [a for p in (good, other_device, other_shape) for a in ("--profile", p)]
    if tool == "plan":
        rc = plan_cli.main(["--cluster", CPU_DEMO, "--model", TINY, "--global-batch-size", "16", "--no-progress",
                            *profiles])
    else:
        rc = predict.main(["--cluster", CPU_DEMO, "--model", TINY, "--plan", DEMO_PLAN, *profiles])
    assert rc == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert "a100.json not used" in lines[0] and "'A100-80GB'" in lines[0] and "CPU" in lines[0]
    assert "wide.json" in lines[1] and "hidden_size=128" in lines[1] and "hidden_size=64" in lines[1]
    assert not any("good.json" in line for line in lines)


def test_a_dense_profile_for_an_moe_model_is_named_not_silently_dropped(tmp_path):
    """A profile of the dense layer of the same sizes no longer prices an MoE layer (perf/profile.py's
    MoE shape keys): the warning says which kind each is, instead of falling back without a word."""
    import dataclasses

    from megatron_het.cli.profiles import unused_profile_reasons
    from megatron_het.cluster import load_cluster, load_model
    from megatron_het.perf.profile import load_profile

    dense = load_model(TINY)
    moe = dataclasses.replace(dense, num_experts=4, moe_router_topk=2, add_bias_linear=False)
    profile = load_profile(_profile(tmp_path / "dense.json"))
    cluster = load_cluster(CPU_DEMO)
    assert unused_profile_reasons([profile], dense, cluster) == []
    (reason,) = unused_profile_reasons([profile], moe, cluster)
    assert "(a dense layer) but the model's layers are" in reason and "num_experts=4" in reason
