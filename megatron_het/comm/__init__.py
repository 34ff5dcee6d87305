"""Hierarchical collectives across islands: native inside an island, a host-staged bridge between.

The C++ `het` torch.distributed backend (csrc/) is used when it can be loaded or compiled; a
pure-Python twin with the same semantics serves otherwise (`het_backend_info()` says which and
why). Reference: docs/communicator.md.
"""

from megatron_het.comm.extension import HetBackendInfo, het_backend_info, load_extension
from megatron_het.comm.group import HetGroup, new_hierarchical_group, register_het_backend
from megatron_het.comm.membership import (
    CommConfigError,
    HetTopology,
    IslandMembership,
    needs_bridge,
    plan_topology,
)
from megatron_het.comm.work import HetCommError, HetWork

__all__ = [
    "CommConfigError",
    "HetBackendInfo",
    "HetCommError",
    "HetGroup",
    "HetTopology",
    "HetWork",
    "IslandMembership",
    "het_backend_info",
    "load_extension",
    "needs_bridge",
    "new_hierarchical_group",
    "plan_topology",
    "register_het_backend",
]
