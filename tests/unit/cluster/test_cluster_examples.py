"""Every example cluster file loads, with the shapes the docs promise."""


import pytest

from megatron_het.cluster import load_cluster

from support.paths import REPO

CLUSTERS = REPO / "examples" / "clusters"
EXPECTED = {  # file: (GPUs by device type, number of links, emulated)
    "cpu-demo": ({"CPU": 4}, 1, True),
    "cpu-demo-paced": ({"CPU": 4}, 1, True),
    "cpu-4": ({"CPU": 4}, 0, False),
    "cpu-pair": ({"CPU": 2}, 1, True),
    "cpu-2": ({"CPU": 2}, 0, False),
    "cpu-resilience": ({"CPU": 6}, 0, True),
    # docs/gpu.md's first job: one node, one island of 8 (MI250X counted per GCD)
    "h100-8": ({"H100-SXM": 8}, 0, False),
    "mi250x-8": ({"MI250X": 8}, 0, False),
    "a100-h100": ({"A100-80GB": 32, "H100-SXM": 16}, 1, False),
    "a100-mi250x": ({"A100-80GB": 32, "MI250X": 16}, 1, False),
    "h100-mi300x": ({"H100-SXM": 32, "MI300X": 32}, 1, False),
    "v100-a100-l40s": ({"V100-32GB": 32, "A100-40GB-PCIe": 8, "L40S": 8}, 3, False),
    # the planner benches' clusters of three or more types (bench/planner_efficiency.py, issue #19)
    "tangram-1024": ({"H100-SXM": 512, "A100-80GB": 384, "MI250X": 128}, 3, False),
    "v100-a100-mi300x": ({"V100-32GB": 64, "A100-80GB": 64, "MI300X": 32}, 3, False),
    "h200-h100-mi300x": ({"H200": 64, "H100-SXM": 64, "MI300X": 64}, 3, False),
    "mixed3-256": ({"H100-SXM": 128, "A100-80GB": 96, "MI250X": 32}, 3, False),
    "four-types": ({"H100-SXM": 64, "A100-40GB": 64, "V100-32GB": 32, "MI300X": 32}, 6, False),
    "a100-l40s-mi250x": ({"A100-80GB": 64, "L40S": 64, "MI250X": 64}, 3, False),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_cluster_loads(name):
    spec = load_cluster(CLUSTERS / f"{name}.yaml")
    gpus, links, emulated = EXPECTED[name]
    assert spec.gpus_by_device_type() == gpus
    assert len(spec.links) == links
    assert spec.emulated is emulated


def test_cpu_demo_shape():
    spec = load_cluster(CLUSTERS / "cpu-demo.yaml")
    assert [(i.name, i.nodes, i.gpus_per_node) for i in spec.islands] == [("fast", 1, 2), ("slow", 1, 2)]
    assert (spec.slowdown("fast"), spec.slowdown("slow")) == (1.0, 2.0)
    assert spec.link("fast", "slow") is not None
    # make demo's: the same islands, paced in CPU time, slow still 2x fast
    paced = load_cluster(CLUSTERS / "cpu-demo-paced.yaml")
    assert [(i.name, i.nodes, i.gpus_per_node) for i in paced.islands] == [("fast", 1, 2), ("slow", 1, 2)]
    assert paced.slowdown("slow") == 2 * paced.slowdown("fast") and paced.emulation_clock("fast") == "thread"


def test_no_unexpected_example_clusters():
    assert {p.stem for p in CLUSTERS.glob("*.yaml")} == set(EXPECTED)
