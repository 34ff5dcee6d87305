"""ClusterSpec built in code: defaults, lookups, aggregates, self-validation."""

import pytest

from megatron_het.cluster import CATALOG, ClusterSpec, ConfigError, IslandEmulation, IslandSpec, LinkSpec


def island(name, device="A100-80GB", nodes=2, gpus_per_node=4, **kw):
    return IslandSpec(name=name, device=CATALOG[device], nodes=nodes, gpus_per_node=gpus_per_node, **kw)


def two_islands(**kw):
    return ClusterSpec(
        islands=(island("a"), island("b", "MI250X", nodes=1, gpus_per_node=8)),
        links=(LinkSpec(between=("a", "b"), bandwidth_gbps=100),),
        **kw,
    )


def test_island_defaults_and_aggregates():
    i = island("a")
    assert i.num_gpus == 8
    assert i.inter_node_bandwidth_gbps == 100.0
    assert i.intra_node_bandwidth_gbps == CATALOG["A100-80GB"].intra_node_bandwidth_gbps == 2400.0
    assert i.peak_tflops == 8 * 312.0
    assert i.memory_gib == 8 * 80.0
    assert island("x", intra_node_bandwidth_gbps=512).intra_node_bandwidth_gbps == 512.0


def test_cluster_lookups_and_totals():
    spec = two_islands()
    assert spec.num_gpus == 16
    assert spec.gpus_by_device_type() == {"A100-80GB": 8, "MI250X": 8}
    assert spec.island("b").device.name == "MI250X"
    assert spec.link("b", "a") is spec.link("a", "b") is spec.links[0]
    assert spec.link("a", "a") is None
    assert spec.links[0].latency_us == 5.0
    assert spec.peak_tflops == pytest.approx(8 * 312 + 8 * 191.5)
    assert not spec.emulated and spec.slowdown("a") == 1.0
    with pytest.raises(KeyError, match="did you mean 'a'"):
        spec.island("aa")


def test_emulation_fills_unlisted_islands_with_one():
    spec = two_islands(emulation={"b": IslandEmulation(slowdown=1.6)})
    assert dict(spec.emulation) == {"a": IslandEmulation(slowdown=1.0), "b": IslandEmulation(slowdown=1.6)}
    assert spec.slowdown("b") == 1.6
    assert spec.emulation_clock("a") == spec.emulation_clock("b") == "wall"  # the default clock
    paced = two_islands(emulation={"b": IslandEmulation(slowdown=4.0, clock="thread")})
    assert paced.emulation_clock("b") == "thread" and paced.emulation_clock("a") == "wall"


def test_single_island_needs_no_link_and_link_is_none():
    spec = ClusterSpec(islands=(island("only"),))
    assert spec.links == () and spec.link("only", "other") is None


def test_missing_link_between_two_islands_is_an_error():
    with pytest.raises(ConfigError, match=r"links: no link between these two islands \(got \['a', 'b'\]\).*default_link"):
        ClusterSpec(islands=(island("a"), island("b")))


def test_in_code_validation_names_field_value_and_limit():
    with pytest.raises(ConfigError, match=r"^nodes: must be >= 1 \(got 0\)\. Fix: use an integer of at least 1$"):
        island("a", nodes=0)
    with pytest.raises(ConfigError, match=r"slowdown: must be >= 1 \(got 0.5\)"):
        IslandEmulation(slowdown=0.5)
    with pytest.raises(ConfigError, match=r"between: a link must join two different islands"):
        LinkSpec(between=("a", "a"), bandwidth_gbps=1)
    with pytest.raises(ConfigError, match=r"latency_us: must be >= 0 \(got -1\)"):
        LinkSpec(between=("a", "b"), bandwidth_gbps=1, latency_us=-1)
