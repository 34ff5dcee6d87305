"""Cluster and model descriptions: device catalog, ClusterSpec, ModelSpec, YAML loading, validation.

Format reference: docs/cluster-format.md. Everything here is pure (no process groups, no torch).
"""

from megatron_het.cluster.catalog import (
    AMD,
    CATALOG,
    COLLECTIVE_LIBRARIES,
    GLOO,
    HOST,
    NCCL,
    NVIDIA,
    RCCL,
    VENDORS,
    DeviceType,
)
from megatron_het.cluster.errors import ConfigError
from megatron_het.cluster.loader import (
    cluster_from_dict,
    load_cluster,
    load_model,
    model_from_dict,
    read_yaml,
    resolve_device_types,
)
from megatron_het.cluster.model_spec import ModelSpec, default_ffn_hidden_size
from megatron_het.cluster.spec import (
    DEFAULT_INTER_NODE_BANDWIDTH_GBPS,
    DEFAULT_INTRA_NODE_LATENCY_US,
    DEFAULT_LINK_LATENCY_US,
    MAX_CLUSTER_GPUS,
    MAX_GPUS_PER_NODE,
    MAX_NODES_PER_ISLAND,
    ClusterSpec,
    IslandEmulation,
    IslandSpec,
    LinkSpec,
)
from megatron_het.cluster.summary import format_catalog, format_cluster, format_model

__all__ = [
    "AMD",
    "CATALOG",
    "COLLECTIVE_LIBRARIES",
    "GLOO",
    "HOST",
    "NCCL",
    "NVIDIA",
    "RCCL",
    "VENDORS",
    "DEFAULT_INTER_NODE_BANDWIDTH_GBPS",
    "DEFAULT_LINK_LATENCY_US",
    "DEFAULT_INTRA_NODE_LATENCY_US",
    "MAX_CLUSTER_GPUS",
    "MAX_GPUS_PER_NODE",
    "MAX_NODES_PER_ISLAND",
    "ClusterSpec",
    "ConfigError",
    "DeviceType",
    "IslandEmulation",
    "IslandSpec",
    "LinkSpec",
    "ModelSpec",
    "cluster_from_dict",
    "default_ffn_hidden_size",
    "format_catalog",
    "format_cluster",
    "format_model",
    "load_cluster",
    "load_model",
    "model_from_dict",
    "read_yaml",
    "resolve_device_types",
]
