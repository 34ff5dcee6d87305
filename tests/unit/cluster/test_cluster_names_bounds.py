"""Names that reach job scripts are plain words; counts and figures are bounded (#21 items 2 and 7)."""

import pytest

from megatron_het.cluster import (
    MAX_CLUSTER_GPUS,
    MAX_GPUS_PER_NODE,
    MAX_NODES_PER_ISLAND,
    ConfigError,
    cluster_from_dict,
    model_from_dict,
)


def _cluster(**island):
    return {"islands": [{"name": "a", "device": "A100-80GB", "nodes": 1, "gpus_per_node": 8, **island}]}


def _error(data, source="c.yaml") -> str:
    with pytest.raises(ConfigError) as info:
        cluster_from_dict(data, source=source)
    return str(info.value)


@pytest.mark.parametrize("name", [
    "a\nsrun rm -rf ~",  # a newline ends the comment the name is written into
    "a$(touch pwned)",  # command substitution
    "a,LD_PRELOAD=/tmp/evil.so",  # a comma adds a variable to srun --export
    "a b", "a'b", 'a"b', "a;b", "a`id`", "", "x" * 65,
])
def test_island_names_outside_the_safe_alphabet_are_refused(name):
    message = _error(_cluster(name=name))
    assert message.startswith("c.yaml: islands[0].name: ")
    assert "letters, digits, '_', '.' or '-'" in message or "non-empty string" in message
    assert "Fix: " in message and "\n" not in message


@pytest.mark.parametrize("name", ["a100-pod", "MI250X_2", "v1.2", "x" * 64])
def test_safe_island_names_load(name):
    assert cluster_from_dict(_cluster(name=name)).island_names == (name,)


def test_device_type_names_are_plain_words_too():
    data = {**_cluster(device="MY GPU\n$(id)"),
            "device_types": [{"name": "MY GPU\n$(id)", "extends": "A100-80GB"}]}
    assert _error(data).startswith("c.yaml: device_types[0].name: must be 1-64 letters")


def test_network_interface_is_optional_and_checked():
    assert cluster_from_dict(_cluster()).islands[0].network_interface is None
    assert cluster_from_dict(_cluster(network_interface="ib0")).islands[0].network_interface == "ib0"
    for bad in ("ib0,eth0", "eth0 ", "$(id)", "averyveryverylongname0"):
        message = _error(_cluster(network_interface=bad))
        assert message.startswith("c.yaml: islands[0].network_interface: must be 1-15 letters"), message
        assert "Fix: write one interface name as 'ip link' lists it" in message


def test_counts_have_sane_bounds():
    assert "islands[0].nodes: must be <= 65,536" in _error(_cluster(nodes=MAX_NODES_PER_ISLAND + 1))
    assert "islands[0].gpus_per_node: must be <= 256" in _error(_cluster(gpus_per_node=MAX_GPUS_PER_NODE + 1))
    # 8 x 10^9 GPUs (the input): refused on the node count, before anything is built per GPU
    assert "(got 1000000000)" in _error(_cluster(nodes=10**9))
    # each island within bounds, the sum not
    islands = [{"name": f"i{k}", "device": "A100-80GB", "nodes": 65_536, "gpus_per_node": 8} for k in range(3)]
    message = _error({"islands": islands, "default_link": {"bandwidth_gbps": 100}})
    assert f"islands: the islands hold 1,572,864 GPUs in all, more than the limit of {MAX_CLUSTER_GPUS:,}" in message
    ok = [{"name": f"i{k}", "device": "A100-80GB", "nodes": 65_536, "gpus_per_node": 1} for k in range(2)]
    assert cluster_from_dict({"islands": ok, "default_link": {"bandwidth_gbps": 100}}).num_gpus == 131_072


def test_infinite_figures_are_refused():
    assert "islands[0].inter_node_bandwidth_gbps: must be a finite number (got inf)" in _error(
        _cluster(inter_node_bandwidth_gbps=float("inf")))


def test_model_sizes_have_sane_bounds():
    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 100}
    assert model_from_dict(base).num_layers == 2
    with pytest.raises(ConfigError, match=r"m\.yaml: num_layers: must be <= 10,000 .*\(got 1000000000\)"):
        model_from_dict({**base, "num_layers": 10**9}, source="m.yaml")
