"""The built-in device catalog: coverage, conventions, read-only-ness, self-validation."""

import dataclasses

import pytest

from megatron_het.cluster import CATALOG, ConfigError, DeviceType

REQUIRED = ("V100-32GB", "A100-40GB", "A100-80GB", "H100-SXM", "H200", "L40S",
            "RTX-4090", "RTX-3080", "MI250X", "MI300X", "CPU")


def test_catalog_has_every_required_type_keyed_by_name():
    for name in REQUIRED:
        assert CATALOG[name].name == name


def test_vendor_and_collective_library_pair_up():
    expected = {"nvidia": "nccl", "amd": "rccl", "cpu": "gloo"}
    for device in CATALOG.values():
        assert device.collective_library == expected[device.vendor], device.name


def test_figures_are_dense_datasheet_numbers():
    assert CATALOG["A100-80GB"].peak_tflops == 312.0
    assert CATALOG["H100-SXM"].peak_tflops == pytest.approx(1979 / 2, rel=1e-3)  # datasheet is sparse
    assert CATALOG["MI300X"].peak_tflops == pytest.approx(1307.4)
    assert CATALOG["H200"].memory_gib == 141.0
    # NVLink 900 GB/s bidirectional -> 450 GB/s one direction -> 3600 Gbit/s
    assert CATALOG["H100-SXM"].intra_node_bandwidth_gbps == 3600.0


def test_mi250x_is_per_gcd_and_says_so():
    mi250x = CATALOG["MI250X"]
    assert mi250x.peak_tflops == pytest.approx(383 / 2)
    assert mi250x.memory_gib == 64.0
    assert "per gcd" in mi250x.source.lower()


def test_every_entry_cites_a_source_and_cpu_is_nominal():
    for device in CATALOG.values():
        assert len(device.source) > 20
    assert all("Datasheet" in d.source or "whitepaper" in d.source for d in CATALOG.values() if d.vendor != "cpu")
    assert "nominal" in CATALOG["CPU"].source.lower()


def test_catalog_is_read_only():
    with pytest.raises(TypeError):
        CATALOG["X"] = CATALOG["CPU"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        CATALOG["CPU"].peak_tflops = 2.0  # type: ignore[misc]


def test_device_type_rejects_bad_vendor_and_nonpositive_rates():
    good = dataclasses.asdict(CATALOG["A100-80GB"])
    with pytest.raises(ConfigError, match=r"vendor: unknown vendor \(got 'intel'\)\. Fix: use one of: nvidia, amd, cpu"):
        DeviceType(**{**good, "vendor": "intel"})
    with pytest.raises(ConfigError, match=r"peak_tflops: must be > 0 \(got -1\)"):
        DeviceType(**{**good, "peak_tflops": -1})
    with pytest.raises(ConfigError, match=r"collective_library: unknown collective library \(got 'mpi'\)"):
        DeviceType(**{**good, "collective_library": "mpi"})
