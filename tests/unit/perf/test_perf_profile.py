"""Profile format: round trip, validation messages, interpolation by tokens."""

import json

import pytest

from megatron_het.cluster import ConfigError
from megatron_het.perf.profile import (
    Profile,
    ProfileEntry,
    load_profile,
    lookup,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)

SHAPE = dict(hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, seq_length=128, tp=1)


def _entry(mbs: int, fwd: float, bwd: float, mem: int) -> dict:
    return {**SHAPE, "micro_batch_size": mbs, "forward_s": fwd, "backward_s": bwd, "peak_memory_bytes": mem}


def _doc(*entries: dict) -> dict:
    return {"format": "megatron-het-profile", "version": 1, "device": "CPU", "method": "test",
            "machine": {"cpu": "x"}, "entries": list(entries)}


DOC = _doc(_entry(1, 1.0, 2.0, 1000), _entry(4, 2.5, 5.0, 4000))


def test_round_trip(tmp_path):
    path = tmp_path / "p.json"
    profile = profile_from_dict(DOC)
    save_profile(profile, path)
    loaded = load_profile(path)
    assert loaded.entries == profile.entries
    assert loaded.source == str(path) and loaded.device == "CPU" and dict(loaded.machine) == {"cpu": "x"}
    assert profile_to_dict(loaded)["entries"][0] == {**_entry(1, 1.0, 2.0, 1000), "num_query_groups": 4,
                                                     "swiglu": False}


def test_backward_split_round_trip_and_validation(tmp_path):
    profile = profile_from_dict({**DOC, "backward_split": {"input_share": 0.57, "weight_share": 0.52, "method": "m"}})
    assert profile.backward_split == (0.57, 0.52) and profile.backward_split_method == "m"
    path = tmp_path / "p.json"
    save_profile(profile, path)
    assert load_profile(path).backward_split == (0.57, 0.52)
    assert profile_from_dict(DOC).backward_split is None and "backward_split" not in profile_to_dict(profile_from_dict(DOC))
    with pytest.raises(ConfigError, match="shares of the fused backward"):
        profile_from_dict({**DOC, "backward_split": {"input_share": 2.5, "weight_share": 0.5}})
    with pytest.raises(ConfigError, match="weight_share"):
        profile_from_dict({**DOC, "backward_split": {"input_share": 0.5}})


def test_interpolation_and_extrapolation_by_tokens():
    profile = profile_from_dict(DOC)
    mid = lookup(profile, micro_batch_size=2, **SHAPE)
    # tokens 256 between 128 (1.0 s) and 512 (2.5 s): 1.0 + 1.5 * 128/384 = 1.5
    assert (mid.forward_s, mid.backward_s, mid.peak_memory_bytes, mid.micro_batch_size) == (1.5, 3.0, 2000, 2)
    assert lookup(profile, micro_batch_size=4, **SHAPE).forward_s == 2.5
    # above: line gives 1.0 + 1.5 * (1024-128)/384 = 4.5; proportional from 4 gives 5.0 -> the larger
    assert lookup(profile, micro_batch_size=8, **SHAPE).forward_s == pytest.approx(5.0)
    single = Profile(device="CPU", method="t", entries=(profile.entries[1],))
    assert lookup(single, micro_batch_size=2, **SHAPE).forward_s == pytest.approx(1.25)
    assert lookup(profile, micro_batch_size=2, **{**SHAPE, "tp": 2}) is None
    assert lookup(profile, micro_batch_size=2, swiglu=True, **SHAPE) is None


def test_entry_is_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        ProfileEntry(256, 4)  # the positional form must not work


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(format="other"), r"format: not a megatron-het profile \(got 'other'\)"),
    (lambda d: d.update(version=2), r"version: unsupported version .*\(got 2\)"),
    (lambda d: d["entries"][0].pop("forward_s"), r"entries\[0\]\.forward_s: required key is missing"),
    (lambda d: d["entries"][1].update(backward_s=-1), r"entries\[1\]\.backward_s: must be > 0 \(got -1\)"),
    (lambda d: d["entries"][0].update(forwrd_s=1), r"entries\[0\]\.forwrd_s: unknown key.*forward_s"),
    (lambda d: d["entries"].append(dict(d["entries"][0])), r"entries\[2\]: duplicate measurement"),
    (lambda d: d.update(entries=[]), r"entries: a profile needs at least one entry"),
])
def test_validation_messages(tmp_path, mutate, message):
    data = json.loads(json.dumps(DOC))
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=message) as info:
        load_profile(path)
    assert str(info.value).startswith(f"{path}: ")
    assert "Fix: " in str(info.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="profile: file not found"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ConfigError, match="profile: not valid JSON"):
        load_profile(tmp_path / "x.json")


def test_call_overhead_round_trip_and_validation(tmp_path):
    doc = {**DOC, "call_overhead": {"forward_s": 8e-4, "backward_s": 5e-4, "stack_layers": 2, "method": "m"}}
    profile = profile_from_dict(doc)
    assert profile.call_overhead == (8e-4, 5e-4) and profile.call_overhead_layers == 2
    path = tmp_path / "p.json"
    save_profile(profile, path)
    loaded = load_profile(path)
    assert (loaded.call_overhead, loaded.call_overhead_layers, loaded.call_overhead_method) == ((8e-4, 5e-4), 2, "m")
    assert profile_from_dict(DOC).call_overhead is None and "call_overhead" not in profile_to_dict(profile_from_dict(DOC))
    with pytest.raises(ConfigError, match="stack_layers"):
        profile_from_dict({**DOC, "call_overhead": {"forward_s": 1e-3, "backward_s": 1e-3, "stack_layers": 1}})


def test_negative_call_overhead_loads_and_is_priced_as_none():
    """An intercept is a difference of two medians: noise can make it negative (measured: -1.4 ms backward at
    load 1.3); the profile keeps the measurement, the model charges no negative fixed cost."""
    from megatron_het.perf.predict import call_overhead_s

    profile = profile_from_dict({**DOC, "call_overhead": {"forward_s": 8e-4, "backward_s": -1.4e-3, "stack_layers": 2}})
    assert profile.call_overhead == (8e-4, -1.4e-3)
    assert call_overhead_s(profile, profile.device) == (8e-4, 0.0, 2)
    assert call_overhead_s(profile_from_dict(DOC), profile.device) == (0.0, 0.0, 1)


def test_island_profile_round_trips_and_wins_over_the_device_types_for_its_island(tmp_path):
    """A profile measured for one island's devices (profiling.host, emulated islands) prices that island;
    other islands of the device type take the profile standing for all of them, or the analytic model."""
    from megatron_het.perf.predict import profile_for

    path = tmp_path / "p.json"
    save_profile(profile_from_dict({**DOC, "island": "slow"}), path)
    slow = load_profile(path)
    assert slow.island == "slow" and profile_to_dict(slow)["island"] == "slow"
    assert "island" not in profile_to_dict(profile_from_dict(DOC))  # written only when set
    every = profile_from_dict(DOC)
    assert profile_for([every, slow], "CPU", "slow") is slow
    assert profile_for([slow, every], "CPU", "fast") is every and profile_for([slow, every], "CPU") is every
    assert profile_for([slow], "CPU", "fast") is None  # another island's times are not this one's
    assert profile_for([slow], "GPU", "slow") is None
    with pytest.raises(ConfigError, match="island"):
        profile_from_dict({**DOC, "island": 3})


MOE = dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=512, moe_token_dispatcher_type="alltoall")


def test_moe_entries_round_trip_and_never_price_the_other_kind(tmp_path):
    """An MoE layer's time is its own shape: a dense entry of the same hidden/FFN sizes never prices it,
    nor an MoE entry a dense layer (or one with other experts, top-k or shared expert)."""
    doc = _doc(_entry(1, 1.0, 2.0, 1000), {**_entry(1, 3.0, 6.0, 3000), **MOE})
    path = tmp_path / "p.json"
    save_profile(profile_from_dict(doc), path)
    profile = load_profile(path)
    assert profile_to_dict(profile)["entries"][0].keys().isdisjoint(MOE)  # dense entries are written as before
    assert lookup(profile, micro_batch_size=1, **SHAPE).forward_s == 1.0
    assert lookup(profile, micro_batch_size=1, **SHAPE, **MOE).forward_s == 3.0
    assert lookup(profile, micro_batch_size=1, **SHAPE, **{**MOE, "moe_router_topk": 1}) is None
    assert lookup(profile, micro_batch_size=1, **SHAPE, **MOE, moe_shared_expert_intermediate_size=256) is None
    assert lookup(profile, micro_batch_size=1, **SHAPE, **{**MOE, "moe_token_dispatcher_type": "allgather"}) is None


def test_moe_entry_validation():
    with pytest.raises(ConfigError, match="moe_ffn_hidden_size, moe_token_dispatcher_type missing"):
        profile_from_dict(_doc({**_entry(1, 1.0, 2.0, 1000), "num_experts": 8, "moe_router_topk": 2}))
    with pytest.raises(ConfigError, match="unknown dispatcher"):
        profile_from_dict(_doc({**_entry(1, 1.0, 2.0, 1000), **MOE, "moe_token_dispatcher_type": "flex"}))
    with pytest.raises(ConfigError, match="exceeds num_experts 2"):
        profile_from_dict(_doc({**_entry(1, 1.0, 2.0, 1000), **MOE, "num_experts": 2, "moe_router_topk": 4}))
    with pytest.raises(ConfigError, match="shared expert without the MoE keys"):
        profile_from_dict(_doc({**_entry(1, 1.0, 2.0, 1000), "moe_shared_expert_intermediate_size": 64}))


def test_layer_shape_of_moe_model():
    from megatron_het.cluster import ModelSpec
    from megatron_het.perf.profile import layer_shape

    dense = ModelSpec(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=100)
    moe = ModelSpec(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=100,
                    num_experts=8, moe_router_topk=2)
    assert "num_experts" not in layer_shape(dense)
    assert layer_shape(moe)["num_experts"] == 8 and layer_shape(moe)["moe_ffn_hidden_size"] == moe.ffn_hidden_size


def test_expert_parallel_entries(tmp_path):
    """An entry measured over EP ranks (tools/profile_host.py --ep-sizes) is its own shape: found only at
    that EP; ``ep`` needs the MoE keys and must divide the experts."""
    doc = _doc({**_entry(1, 3.0, 6.0, 3000), **MOE}, {**_entry(1, 4.0, 7.0, 2000), **MOE, "ep": 2})
    path = tmp_path / "p.json"
    save_profile(profile_from_dict(doc), path)
    profile = load_profile(path)
    assert [e.ep for e in profile.entries] == [1, 2] and "ep" not in profile_to_dict(profile)["entries"][0]
    assert lookup(profile, micro_batch_size=1, **SHAPE, **MOE, ep=2).forward_s == 4.0
    assert lookup(profile, micro_batch_size=1, **SHAPE, **MOE).forward_s == 3.0
    assert lookup(profile, micro_batch_size=1, **SHAPE, **MOE, ep=4) is None
    with pytest.raises(ConfigError, match="expert parallelism without the MoE keys"):
        profile_from_dict(_doc({**_entry(1, 1.0, 2.0, 1000), "ep": 2}))
    with pytest.raises(ConfigError, match="does not divide num_experts 8"):
        profile_from_dict(_doc({**_entry(1, 1.0, 2.0, 1000), **MOE, "ep": 3}))
