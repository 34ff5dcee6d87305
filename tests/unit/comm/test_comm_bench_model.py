"""The byte model of bench/communicator.py: crossing edges, pipe bytes, expected ratios, wire parsing."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from support.paths import REPO

_PATH = REPO / "bench" / "communicator.py"
_SPEC = importlib.util.spec_from_file_location("bench_communicator", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = bench
sys.path.insert(0, str(_PATH.parent))  # the script imports its sibling bench/harness.py, as `python bench/...` does
try:
    _SPEC.loader.exec_module(bench)
finally:
    sys.path.remove(str(_PATH.parent))

MIB = 1 << 20


@pytest.mark.parametrize("name, in_order, interleaved", [
    ("2x2", 1.5, 3.0),          # k(n-1)/(n(k-1)) = 2*3/4;  (n-1)/(k-1) = 3
    ("2x4", 1.75, 7.0),         # 2*7/8; 7
    ("4x2", 7 / 6, 7 / 3),      # 4*7/(8*3); 7/3
])
def test_expected_bytes_ratio_by_hand(name, in_order, interleaved):
    k, m = bench.CONFIGS[name]
    assert bench.expected_bytes_ratio("flat_in_order", k, m) == pytest.approx(in_order, rel=1e-12)
    assert bench.expected_bytes_ratio("flat_interleaved", k, m) == pytest.approx(interleaved, rel=1e-12)


def test_crossing_edges_of_both_placements():
    assert bench.crossing_edges(bench.placement("flat_in_order", 2, 4), 8) == [3, 7]
    assert bench.crossing_edges(bench.placement("flat_interleaved", 2, 4), 8) == list(range(8))
    assert bench.crossing_edges(bench.placement("flat_in_order", 4, 2), 8) == [1, 3, 5, 7]


def test_flat_pipe_bytes_per_island():
    # 2x4 in order: one crossing edge per island carrying 2(n-1)/n S = 1.75 S
    assert bench.flat_pipe_bytes(bench.placement("flat_in_order", 2, 4), 8, 8 * MIB) == {0: 14 * MIB, 1: 14 * MIB}
    # 2x4 interleaved: four crossing edges per island, 7 S per pipe
    assert bench.flat_pipe_bytes(bench.placement("flat_interleaved", 2, 4), 8, 8 * MIB) == {0: 56 * MIB, 1: 56 * MIB}
    # 4x2 interleaved (r % 4): two crossing edges per island, 3.5 S per pipe
    pipes = bench.flat_pipe_bytes(bench.placement("flat_interleaved", 4, 2), 8, 8 * MIB)
    assert pipes == {i: 28 * MIB for i in range(4)}


SS_SAMPLE = """\
0      0      127.0.0.1:40001 127.0.0.1:50002 users:(("python",pid=11,fd=7))
\t bbr wscale:7,7 rto:204 mss:32768 bytes_sent:1000 bytes_acked:1001 segs_out:3
0      0      127.0.0.1:50002 127.0.0.1:40001 users:(("python",pid=12,fd=9))
\t bbr wscale:7,7 rto:204 mss:32768 bytes_sent:250 bytes_received:1000
0      0      127.0.0.1:40003 127.0.0.1:60000 users:(("other",pid=99,fd=3))
\t bbr bytes_sent:77777
0      0      127.0.0.1:40004 127.0.0.1:50005 users:(("python",pid=13,fd=4))
\t bbr rto:204 bytes_received:5
0      0      127.0.0.1:50005 127.0.0.1:40004 users:(("python",pid=11,fd=8))
\t bbr bytes_sent:5
0      0      127.0.0.1:40001 127.0.0.1:50009 users:(("python",pid=13,fd=5))
\t bbr bytes_sent:40
0      0      127.0.0.1:50009 127.0.0.1:40001 users:(("python",pid=12,fd=6))
\t bbr bytes_sent:0
"""


def test_wire_matrix_parses_ss_and_keeps_only_this_runs_ranks():
    table = bench.parse_ss(SS_SAMPLE)
    assert table[0] == (11, "127.0.0.1:40001", "127.0.0.1:50002", 1000)
    assert table[3] == (13, "127.0.0.1:40004", "127.0.0.1:50005", 0)  # no bytes_sent field: 0
    matrix = bench.wire_matrix(table, pids=[11, 12, 13])
    # pid 99 is not a rank: ignored. Local port 40001 is used by pid 11 (to 50002) and pid 13 (to
    # 50009, an ephemeral port reused for another peer): only the address pair tells them apart.
    assert matrix == [[0, 1000, 5], [250, 0, 0], [0, 40, 0]]
    assert bench.cross_island_bytes(matrix, lambda r: 0 if r < 2 else 1) == 45
    assert bench.cross_island_bytes(matrix, lambda r: r) == 1295
