"""Pure parts of the communicator: membership validation, topology, bridge detection, settings."""

from __future__ import annotations

import pytest

from megatron_het.comm import CommConfigError, IslandMembership, needs_bridge, plan_topology
from megatron_het.comm.diagnose import Behind, failure_message
from megatron_het.comm.group import _check_settings

MEMBERSHIP = IslandMembership(rank_to_island={0: "mi", 1: "a100", 2: "a100", 3: "mi", 4: "cpu", 5: "a100"},
                              island_backend={"a100": "nccl", "mi": "nccl", "cpu": "gloo"})


def test_topology_orders_islands_by_leader_rank():
    topo = plan_topology([5, 4, 3, 2, 1, 0], MEMBERSHIP)
    assert topo.ranks == (0, 1, 2, 3, 4, 5)
    assert topo.islands == ("mi", "a100", "cpu")
    assert topo.members == ((0, 3), (1, 2, 5), (4,))
    assert topo.leaders == (0, 1, 4)
    assert topo.island_of_group_rank() == [0, 1, 1, 0, 2, 1]
    assert topo.intra_rank_of_group_rank() == [0, 0, 1, 1, 0, 2]
    assert topo.leader_group_ranks() == [0, 1, 4]


def test_topology_of_a_subset_uses_group_ranks():
    topo = plan_topology([2, 3, 5], MEMBERSHIP)
    assert topo.members == ((2, 5), (3,))
    assert topo.leader_group_ranks() == [0, 1]
    assert topo.group_rank(5) == 2


def test_needs_bridge_only_when_backends_differ():
    assert needs_bridge([1, 2, 4], MEMBERSHIP) is True  # nccl + gloo
    # NVIDIA and AMD islands both say "nccl" in torch, but are separate islands: same backend
    # name alone does not need a bridge; different names do.
    assert needs_bridge([0, 1], MEMBERSHIP) is False
    assert needs_bridge([1, 2], MEMBERSHIP) is False


def test_membership_rejects_unknown_island_and_backend():
    with pytest.raises(CommConfigError, match=r"rank_to_island\[1\] = 'x' has no entry in island_backend"):
        IslandMembership(rank_to_island={0: "a", 1: "x"}, island_backend={"a": "gloo"})
    with pytest.raises(CommConfigError, match=r"island_backend\['a'\] = 'rccl' is not a torch backend name"):
        IslandMembership(rank_to_island={0: "a"}, island_backend={"a": "rccl"})


def test_ranks_are_validated():
    with pytest.raises(CommConfigError, match=r"ranks \[9\] have no island"):
        plan_topology([0, 9], MEMBERSHIP)
    with pytest.raises(CommConfigError, match=r"ranks lists \[1\] more than once"):
        plan_topology([1, 1, 2], MEMBERSHIP)
    with pytest.raises(CommConfigError, match="ranks is empty"):
        needs_bridge([], MEMBERSHIP)


def test_settings_are_validated_with_value_and_limit():
    with pytest.raises(CommConfigError, match=r"chunk_bytes = 10 is below the minimum 1024"):
        _check_settings(60, 10, "auto", 0.0)
    with pytest.raises(CommConfigError, match=r"timeout_s = 0 must be > 0"):
        _check_settings(0, 4096, "auto", 0.0)
    with pytest.raises(CommConfigError, match=r"implementation = 'mpi' is not one of"):
        _check_settings(60, 4096, "mpi", 0.0)
    with pytest.raises(CommConfigError, match=r"link_bytes_per_s = -1 must be >= 0"):
        _check_settings(60, 4096, "auto", -1)


def test_failure_message_names_group_rank_and_missing_ranks():
    msg = failure_message(group="7", rank=1, op="all_reduce", seq=4, waited_s=3.04, timeout_s=3,
                          behind=Behind(ranks=[(2, 3)]), global_ranks=(0, 1, 5), cause="Timed out")
    assert msg.startswith("het group '7': rank 1 all_reduce #4 failed after 3.0 s (timeout 3 s)")
    assert "rank 5 (group rank 2, last entered #3)" in msg
    assert msg.endswith("Cause: Timed out")
