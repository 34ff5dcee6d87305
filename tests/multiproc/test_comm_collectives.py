"""Hierarchical collectives vs flat gloo, for the C++ `het` backend and the Python twin.

Islands are emulated as rank blocks on gloo. One 6-rank spawn runs every case for both
implementations (a spawn costs ~20 s of imports on 2 cores); the tests below read its parts.
The C++ extension is compiled once per session (cached under build/het_ext, reused by the ranks).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_het.comm import het_backend_info
from megatron_het.platform.local_launch import run_local

import workers.comm_workers as comm_workers  # rank functions; no tests inside
from support.paths import REPO, TESTS

ENV = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])}
SKIP_TIMEOUT_S = 2.0  # the timeout comm_workers._skip gives its group


@pytest.fixture(scope="module")
def implementations() -> list[str]:
    info = het_backend_info()  # compiles csrc/ once when no cached build exists
    return ["cpp", "python"] if info.implementation == "cpp" else ["python"]


@pytest.fixture(scope="module")
def results(implementations) -> list[dict]:
    return run_local(6, comm_workers.all_cases, (implementations,), env=ENV, timeout_s=400)


def _check(per_rank: list[dict], implementations: list[str], members: int) -> None:
    for rank, per_impl in enumerate(per_rank):
        assert sorted(per_impl) == sorted(implementations)
        for impl, res in per_impl.items():
            assert res["member"] is (rank < members)
            if res["member"]:
                assert res["implementation"] == impl
                assert res["bad"] == [], f"rank {rank} {impl}: {res['bad']}"


@pytest.mark.multiproc
def test_two_islands_of_two_match_flat(results, implementations):
    two = [r["two"] for r in results]
    _check(two, implementations, members=4)
    for impl in implementations:
        sent = [r[impl]["bridge_bytes"] for r in two[:4]]
        # 2+2: both members hold an all-reduce shard; leaders also carry the other collectives
        assert sent[1] == sent[3] > 10_000
        assert sent[0] == sent[2] > sent[1]
    if "cpp" in implementations:  # both implementations account the same bytes
        assert [r["cpp"]["bridge_bytes"] for r in two[:4]] == [r["python"]["bridge_bytes"] for r in two[:4]]


def _expected_bridge_bytes(island_sizes: list[int], numel: int, chunk_elems: int) -> list[int]:
    """The sharded all-reduce's ring model, written out independently of the implementation: S =
    the smallest island; shard j (contiguous, the first numel % S one element longer) is held by
    member j of every island, which sends 2(k-1)/k of each of its 4-byte chunks; others send nothing."""
    k, shards = len(island_sizes), min(island_sizes)
    out = []
    for size in island_sizes:
        for j in range(size):
            elems = numel // shards + (1 if j < numel % shards else 0) if j < shards else 0
            chunks = [chunk_elems] * (elems // chunk_elems) + ([elems % chunk_elems] if elems % chunk_elems else [])
            out.append(sum(2 * (k - 1) * 4 * c // k for c in chunks))
    return out


@pytest.mark.multiproc
def test_sharded_all_reduce_over_unequal_islands(results, implementations):
    """Islands 3+2, 2+2+1, 4+2, 3+3; sum and avg; fp32, fp64, bf16; sizes 1, 2 (below the shard
    count), 37, 700, 1025 (several 1 KiB chunks): every element within the rounding bound of a
    float64 sum (comm_workers._sharded_all_reduce). Bridge bytes: only shard holders send, each
    2(k-1)/k of its shard, the same in both implementations."""
    for sizes in comm_workers.SHARDED_ISLANDS:
        n = sum(sizes)
        for impl in implementations:
            per_rank = [results[r]["sharded"][impl][str(sizes)] for r in range(6)]
            assert [p["member"] for p in per_rank] == [r < n for r in range(6)]
            for rank, p in enumerate(per_rank[:n]):
                assert p["bad"] == [], f"islands {sizes} rank {rank} {impl}: {p['bad']}"
            sent = [p["bridge_bytes"] for p in per_rank[:n]]
            assert sent == _expected_bridge_bytes(sizes, comm_workers.BYTES_PROBE, 1024 // 4), (sizes, impl, sent)
    # 3+2 written out: 700 fp32 = two shards of 350 elements (1,400 bytes; k = 2 sends all of it once)
    # held by ranks 0, 1 and 3, 4; rank 2 (the larger island's third member) sends nothing across
    assert [results[r]["sharded"][implementations[0]]["[3, 2]"]["bridge_bytes"] for r in range(5)] == \
        [1400, 1400, 0, 1400, 1400]


@pytest.mark.multiproc
def test_uneven_collectives_over_the_bridge_as_sharded_all_reduce(results, implementations):
    """comm.uneven's reduce-scatter / all-gather over islands 4+2, leader-based and as the sharded
    all-reduce (the distributed optimizer's choice there): exact gather, summed slice within the
    fp32 rounding bound. Across the boundary the all-reduce form spreads the bytes over both members
    of each island (no rank sends more than a leader does in the leader-based form)."""
    for impl in implementations:
        for method in ("leaders", "all_reduce"):
            per_rank = [results[r]["uneven"][impl][method] for r in range(6)]
            for rank, p in enumerate(per_rank):
                assert p["member"] and p["bad"] == [], (impl, method, rank, p)
        lead = [results[r]["uneven"][impl]["leaders"] for r in range(6)]
        shard = [results[r]["uneven"][impl]["all_reduce"] for r in range(6)]
        for kind in ("rs_bytes", "ag_bytes"):
            assert [p[kind] > 0 for p in lead] == [True, False, False, False, True, False]  # leaders 0 and 4
            assert [p[kind] > 0 for p in shard] == [True, True, False, False, True, True]  # holders 0, 1 and 4, 5
            assert max(p[kind] for p in shard) <= max(p[kind] for p in lead)


@pytest.mark.multiproc
def test_three_uneven_islands_match_flat(results, implementations):
    three = [r["three"] for r in results]
    _check(three, implementations, members=6)
    assert [three[r][implementations[0]]["is_leader"] for r in range(6)] == [True, True, False, True, False, False]


@pytest.mark.multiproc
def test_missing_rank_is_named_within_the_timeout(results, implementations):
    for impl in implementations:
        for rank in (0, 1, 2):
            res = results[rank]["skip"][impl]
            assert res["error"] is not None, f"rank {rank} {impl} did not fail"
            assert res["elapsed"] < SKIP_TIMEOUT_S + 1.5, (rank, impl, res["elapsed"])
            assert "het group '" in res["error"]
            assert f"rank {rank} all_reduce #2 failed" in res["error"]
            assert "never entered it: rank 3" in res["error"], res["error"]


def test_python_fallback_is_reported_without_compiler_or_jit():
    code = ("from megatron_het.comm import het_backend_info as f; i = f(); "
            "print(i.implementation, '|', i.reason)")
    env = dict(os.environ, MEGATRON_HET_NO_JIT="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=REPO).stdout.strip()
    import importlib.util

    from megatron_het.comm.extension import PREBUILT_MODULE

    if importlib.util.find_spec(PREBUILT_MODULE) is not None:
        # `pip install -e .` built the extension (a fresh clone's bootstrap does): it wins, and says so
        assert out.startswith("cpp |") and "prebuilt" in out, out
    else:
        assert out.startswith("python |"), out
        assert "MEGATRON_HET_NO_JIT=1" in out
