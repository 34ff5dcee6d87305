"""Cluster YAML loading: the happy path, device-type overrides, and every error the issue lists."""

import textwrap
from pathlib import Path

import pytest

from megatron_het.cluster import CATALOG, ConfigError, cluster_from_dict, load_cluster

GOOD = """\
islands:
  - name: a100-pod
    device: A100-80GB
    nodes: 4
    gpus_per_node: 8
    inter_node_bandwidth_gbps: 200
  - name: mi250-pod
    device: MI250X
    nodes: 2
    gpus_per_node: 8
links:
  - between: [a100-pod, mi250-pod]
    bandwidth_gbps: 100
    latency_us: 10
emulation:
  a100-pod: {slowdown: 1.0}
  mi250-pod: {slowdown: 1.6}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def load_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message  # every error names the file
    assert "Fix: " in message
    return message


def test_issue_example_loads(tmp_path):
    spec = load_cluster(write(tmp_path, GOOD))
    assert [i.name for i in spec.islands] == ["a100-pod", "mi250-pod"]
    a100, mi250 = spec.islands
    assert (a100.device, a100.nodes, a100.gpus_per_node, a100.inter_node_bandwidth_gbps) == (CATALOG["A100-80GB"], 4, 8, 200.0)
    assert mi250.inter_node_bandwidth_gbps == 100.0  # documented default
    assert mi250.intra_node_bandwidth_gbps == 1600.0  # from the device type
    assert spec.link("mi250-pod", "a100-pod").bandwidth_gbps == 100.0
    assert spec.link("a100-pod", "mi250-pod").latency_us == 10.0
    assert spec.slowdown("mi250-pod") == 1.6
    assert spec.num_gpus == 48 and spec.source == str(tmp_path / "cluster.yaml")


def test_device_types_extend_override_and_define(tmp_path):
    spec = load_cluster(write(tmp_path, """\
        device_types:
          - name: A100-80GB-PCIe
            extends: A100-80GB
            intra_node_bandwidth_gbps: 512
          - name: MY-GPU
            vendor: amd
            peak_tflops: 100
            memory_gib: 32
            memory_bandwidth_gbs: 1000
            intra_node_bandwidth_gbps: 400
          - name: CPU
            peak_tflops: 0.5
        islands:
          - {name: p, device: A100-80GB-PCIe, nodes: 1, gpus_per_node: 2}
          - {name: m, device: MY-GPU, nodes: 1, gpus_per_node: 2}
          - {name: c, device: CPU, nodes: 1, gpus_per_node: 2}
        default_link: {bandwidth_gbps: 10}
        """))
    pcie, mine, cpu = (i.device for i in spec.islands)
    assert (pcie.name, pcie.peak_tflops, pcie.memory_gib, pcie.intra_node_bandwidth_gbps) == ("A100-80GB-PCIe", 312.0, 80.0, 512.0)
    assert pcie.source.startswith("NVIDIA A100") and "overridden" in pcie.source
    assert (mine.vendor, mine.collective_library, mine.peak_tflops) == ("amd", "rccl", 100.0)
    assert (cpu.peak_tflops, cpu.memory_gib) == (0.5, 16.0)
    assert CATALOG["CPU"].peak_tflops == 1.0  # the built-in catalog is untouched
    assert len(spec.links) == 3 and all(l.bandwidth_gbps == 10 and l.latency_us == 5 for l in spec.links)


def test_default_link_only_fills_missing_pairs(tmp_path):
    spec = load_cluster(write(tmp_path, """\
        islands:
          - {name: a, device: CPU, nodes: 1, gpus_per_node: 1}
          - {name: b, device: CPU, nodes: 1, gpus_per_node: 1}
          - {name: c, device: CPU, nodes: 1, gpus_per_node: 1}
        links:
          - {between: [a, b], bandwidth_gbps: 50}
        default_link: {bandwidth_gbps: 5, latency_us: 30}
        """))
    assert spec.link("a", "b").bandwidth_gbps == 50
    assert (spec.link("c", "a").bandwidth_gbps, spec.link("b", "c").latency_us) == (5, 30)


def test_single_island_without_links(tmp_path):
    spec = load_cluster(write(tmp_path, "islands: [{name: solo, device: CPU, nodes: 1, gpus_per_node: 4}]\n"))
    assert spec.links == () and spec.num_gpus == 4 and dict(spec.emulation) == {}


ISLAND_B = "  - {name: b, device: CPU, nodes: 1, gpus_per_node: 1}\n"
LINK_AB = "links: [{between: [a, b], bandwidth_gbps: 10}]\n"


def islands_a_b(a: str = "{name: a, device: CPU, nodes: 1, gpus_per_node: 1}") -> str:
    return f"islands:\n  - {a}\n{ISLAND_B}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # unknown device type: nearest catalog names
        (islands_a_b("{name: a, device: A100-80G, nodes: 1, gpus_per_node: 1}") + LINK_AB,
         "islands[0].device: unknown device type (got 'A100-80G'). Fix: did you mean 'A100-80GB'"),
        (islands_a_b("{name: a, device: mi250x, nodes: 1, gpus_per_node: 1}") + LINK_AB,
         "did you mean 'MI250X'"),
        # typo in a key: nearest valid key
        (islands_a_b("{name: a, device: CPU, nodes: 1, gpus_per_nod: 1}") + LINK_AB,
         "islands[0].gpus_per_nod: unknown key (got 'gpus_per_nod'). Fix: did you mean 'gpus_per_node'"),
        (islands_a_b() + "linkz: []\n", "linkz: unknown key (got 'linkz'). Fix: did you mean 'links'"),
        # link naming an unknown island
        (islands_a_b() + "links: [{between: [a, bb], bandwidth_gbps: 10}]\n",
         "links[0].between: link names an unknown island (got 'bb'). Fix: did you mean 'b'"),
        # non-positive bandwidths
        (islands_a_b() + "links: [{between: [a, b], bandwidth_gbps: 0}]\n",
         "links[0].bandwidth_gbps: must be > 0 (got 0)"),
        (islands_a_b("{name: a, device: CPU, nodes: 1, gpus_per_node: 1, inter_node_bandwidth_gbps: -5}") + LINK_AB,
         "islands[0].inter_node_bandwidth_gbps: must be > 0 (got -5)"),
        # zero GPUs or nodes
        (islands_a_b("{name: a, device: CPU, nodes: 1, gpus_per_node: 0}") + LINK_AB,
         "islands[0].gpus_per_node: must be >= 1 (got 0). Fix: use an integer of at least 1"),
        (islands_a_b("{name: a, device: CPU, nodes: 0, gpus_per_node: 1}") + LINK_AB,
         "islands[0].nodes: must be >= 1 (got 0)"),
        # duplicate island names
        (islands_a_b("{name: b, device: CPU, nodes: 1, gpus_per_node: 1}"),
         "islands[1].name: duplicate island name (also islands[0]) (got 'b'). Fix: give every island a unique name"),
        # wrong types
        (islands_a_b("{name: a, device: CPU, nodes: '4', gpus_per_node: 1}") + LINK_AB,
         "islands[0].nodes: must be an integer, not str (got '4'). Fix: write a whole number >= 1 (remove the quotes: 4)"),
        (islands_a_b("{name: a, device: CPU, nodes: 1, gpus_per_node: 1, intra_node_bandwidth_gbps: fast}") + LINK_AB,
         "islands[0].intra_node_bandwidth_gbps: must be a number, not str (got 'fast')"),
        ("islands: {name: a}\n", "islands: must be a list, not dict"),
        # emulation
        (islands_a_b() + LINK_AB + "emulation: {c: {slowdown: 2}}\n",
         "emulation.c: emulation names an unknown island (got 'c')"),
        (islands_a_b() + LINK_AB + "emulation: {a: {slowdown: 0.5}}\n",
         "emulation.a.slowdown: must be >= 1 (got 0.5). Fix: use a number >= 1"),
        (islands_a_b() + LINK_AB + "emulation: {a: {slowdwn: 2}}\n",
         "emulation.a.slowdwn: unknown key (got 'slowdwn'). Fix: did you mean 'slowdown'"),
        (islands_a_b() + LINK_AB + "emulation: {a: {slowdown: 2, clock: cpu}}\n",
         "emulation.a.clock: unknown emulation clock 'cpu' (got 'cpu'). Fix: use one of wall, thread"),
        # links: missing, duplicate, self
        (islands_a_b(), "links: no link between these two islands (got ['a', 'b'])"),
        (islands_a_b() + "links: [{between: [a, b], bandwidth_gbps: 1}, {between: [b, a], bandwidth_gbps: 2}]\n",
         "links[1].between: duplicate link (also links[0]) (got ['b', 'a'])"),
        (islands_a_b() + "links: [{between: [a], bandwidth_gbps: 1}]\n",
         "links[0].between: must name exactly two islands (got ('a',))"),
        # required keys and device types
        ("islands: [{name: a, nodes: 1, gpus_per_node: 1}]\n",
         "islands[0].device: required key is missing (got None). Fix: add 'device:' to islands[0]"),
        ("links: []\n", "islands: required key is missing"),
        ("device_types: [{name: NEW, peak_tflops: 5}]\nislands: [{name: a, device: NEW, nodes: 1, gpus_per_node: 1}]\n",
         "device_types[0].name: new device type lacks vendor, memory_gib, memory_bandwidth_gbs, intra_node_bandwidth_gbps"),
        ("device_types: [{name: NEW, extends: H100}]\nislands: [{name: a, device: NEW, nodes: 1, gpus_per_node: 1}]\n",
         "device_types[0].extends: unknown device type to extend (got 'H100'). Fix: did you mean 'H100-SXM'"),
        ("device_types: [{name: NEW, extends: CPU, vendor: intel}]\nislands: [{name: a, device: NEW, nodes: 1, gpus_per_node: 1}]\n",
         "device_types[0].vendor: unknown vendor (got 'intel')"),
        ("- just\n- a list\n", "(top level): must be a mapping of keys to values, not list"),
    ],
)
def test_bad_cluster_files_get_clear_errors(tmp_path, text, expected):
    assert expected in load_error(tmp_path, text)


def test_yaml_syntax_error_names_the_line(tmp_path):
    message = load_error(tmp_path, "islands:\n  - name: a\n    device: [CPU\n    nodes: 1\n")
    assert "YAML syntax error" in message
    assert "line 4" in message or "line 3" in message
    assert "correct line" in message


def test_yaml_bad_indentation_reports_its_line(tmp_path):
    message = load_error(tmp_path, "islands:\n  - name: a\n    device: CPU\n   nodes: 1\n")
    assert ": line 4, column 4: YAML syntax error" in message
    assert "(got '   nodes: 1')" in message


def test_duplicate_yaml_key_is_caught_with_line(tmp_path):
    message = load_error(tmp_path, "islands:\n  - name: a\n    nodes: 1\n    nodes: 2\n")
    assert "line 4" in message and "found duplicate key 'nodes'" in message


@pytest.mark.parametrize("text", ["", "   \n", "# only a comment\n"])
def test_empty_file(tmp_path, text):
    assert "(top level): file is empty" in load_error(tmp_path, text)


def test_file_not_found(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"nope\.yaml: path: file not found .*Fix: check the path"):
        load_cluster(missing)


def test_errors_from_dicts_have_no_file_prefix():
    with pytest.raises(ConfigError) as info:
        cluster_from_dict({"islands": [{"name": "a", "device": "CPU", "nodes": 0, "gpus_per_node": 1}]})
    assert str(info.value).startswith("islands[0].nodes: must be >= 1 (got 0)")
    assert (info.value.field, info.value.value, info.value.file) == ("islands[0].nodes", 0, None)
