"""YAML files -> ClusterSpec / ModelSpec, with every mistake reported as a ConfigError.

The loader checks structure (mappings, lists, known keys) and resolves names (device types,
``default_link``); the dataclasses check values. Errors from either carry the file and the
full field path.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from megatron_het.cluster.catalog import CATALOG, DEFAULT_COLLECTIVE_LIBRARY, DeviceType
from megatron_het.cluster.errors import ConfigError, suggest
from megatron_het.cluster.fields import as_list, as_mapping, as_name, check_keys, join
from megatron_het.cluster.model_spec import ModelSpec
from megatron_het.cluster.spec import ClusterSpec, IslandEmulation, IslandSpec, LinkSpec

__all__ = ["read_yaml", "load_cluster", "cluster_from_dict", "load_model", "model_from_dict", "resolve_device_types"]

TOP = "(top level)"  # field path of the document itself

_CLUSTER_KEYS = ("device_types", "islands", "links", "default_link", "emulation")
_ISLAND_KEYS = ("name", "device", "nodes", "gpus_per_node", "inter_node_bandwidth_gbps", "intra_node_bandwidth_gbps",
                "intra_node_latency_us", "inter_node_latency_us", "network_interface")
_LINK_KEYS = ("between", "bandwidth_gbps", "latency_us")
_DEVICE_KEYS = tuple(f.name for f in dataclasses.fields(DeviceType))
_MODEL_KEYS = tuple(f.name for f in dataclasses.fields(ModelSpec))
_MODEL_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (plain YAML silently keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):
                continue  # unhashable keys are reported by the base class
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """Parse a YAML file; missing, unreadable, empty and malformed files become ConfigErrors."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file not found", field="path", value=file, file=file,
                          fix="check the path; examples are in examples/clusters/ and examples/models/") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read the file ({err.__class__.__name__}: {err})", field="path", value=file,
                          file=file, fix="pass a readable UTF-8 YAML file") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise ConfigError("nested too deeply to read", field=TOP, value=file, file=file,
                          fix="pass a cluster or model file as described in docs/cluster-format.md") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        lines = text.splitlines()
        line = mark.line + 1 if mark is not None else 0
        snippet = lines[line - 1] if 0 < line <= len(lines) else ""
        fix = (f"correct line {line}: check indentation, the ':' after each key, "
               "and that quotes and brackets are closed")
        if "could not determine a constructor" in str(err.problem):  # !!python/... and other tags
            fix = f"remove the tag on line {line}: cluster and model files are plain data"
        raise ConfigError(f"YAML syntax error: {err.problem or err.context}", file=file,
                          field=f"line {line}, column {mark.column + 1 if mark else 0}", value=snippet,
                          fix=fix) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"YAML error: {' '.join(str(err).split())}", field=TOP, value=file, file=file,
                          fix="make the file valid YAML") from None
    if data is None:
        raise ConfigError("file is empty (or only comments)", field=TOP, value=text[:40], file=file,
                          fix="write the settings; see docs/cluster-format.md and the examples/ folder")
    return data


def resolve_device_types(entries: object, base: Mapping[str, DeviceType] = CATALOG) -> dict[str, DeviceType]:
    """The catalog with a cluster file's ``device_types:`` list applied, in order.

    An entry whose name is already known overrides it field by field; ``extends: X`` copies X
    (catalog or an earlier entry) then overrides; otherwise every figure must be given.
    """
    types_ = dict(base)
    defined: dict[str, int] = {}
    for i, raw in enumerate(as_list(entries, "device_types", example="[{name: MY-GPU, extends: A100-80GB}]")):
        path = join("device_types", i)
        item = as_mapping(raw, path, example="{name: MY-GPU, extends: A100-80GB, memory_gib: 40}")
        check_keys(item, path, allowed=(*_DEVICE_KEYS, "extends"), required=("name",))
        name = as_name(item["name"], join(path, "name"), example="'MY-GPU'")
        if name in defined:
            raise ConfigError(f"device type defined twice (also device_types[{defined[name]}])",
                              field=join(path, "name"), value=name, fix="merge the two entries into one")
        defined[name] = i
        fields = {k: v for k, v in item.items() if k != "extends"}
        parent = item.get("extends", name if name in types_ else None)
        try:
            if parent is not None:
                if parent not in types_:
                    raise ConfigError("unknown device type to extend", field="extends", value=parent,
                                      fix=suggest(str(parent), types_, what="device types"))
                fields.setdefault("source", f"{types_[parent].source} (overridden in the cluster file)")
                types_[name] = dataclasses.replace(types_[parent], **fields)
            else:
                missing = [k for k in ("vendor", "peak_tflops", "memory_gib", "memory_bandwidth_gbs",
                                       "intra_node_bandwidth_gbps") if k not in fields]
                if missing:
                    raise ConfigError(f"new device type lacks {', '.join(missing)}", field="name", value=name,
                                      fix=f"give {', '.join(missing)}, or 'extends: <catalog type>' to copy "
                                          "the rest from a known type")
                vendor = fields["vendor"]
                if isinstance(vendor, str) and vendor in DEFAULT_COLLECTIVE_LIBRARY:
                    fields.setdefault("collective_library", DEFAULT_COLLECTIVE_LIBRARY[vendor])
                fields.setdefault("collective_library", None)  # vendor is bad: let DeviceType name it
                fields.setdefault("source", "user-defined in the cluster file")
                types_[name] = DeviceType(**fields)
        except ConfigError as err:
            raise err.located(prefix=path) from None
    return types_


def _island(raw: object, i: int, devices: Mapping[str, DeviceType]) -> IslandSpec:
    path = join("islands", i)
    item = as_mapping(raw, path, example="{name: a100-pod, device: A100-80GB, nodes: 4, gpus_per_node: 8}")
    check_keys(item, path, allowed=_ISLAND_KEYS, required=("name", "device", "nodes", "gpus_per_node"))
    device = item["device"]
    if not isinstance(device, str) or device not in devices:
        raise ConfigError("unknown device type", field=join(path, "device"), value=device,
                          fix=suggest(str(device), devices, what="device types") +
                          " (or define it under device_types:)")
    try:
        return IslandSpec(**{**item, "device": devices[device]})
    except ConfigError as err:
        raise err.located(prefix=path) from None


def _link(raw: object, path: str, *, between: object = None) -> LinkSpec:
    item = as_mapping(raw, path, example="{between: [a, b], bandwidth_gbps: 100, latency_us: 5}")
    if between is None:
        check_keys(item, path, allowed=_LINK_KEYS, required=("between", "bandwidth_gbps"))
        between = as_list(item["between"], join(path, "between"), example="[a100-pod, mi250-pod]")
    else:  # default_link: the pair is implied
        check_keys(item, path, allowed=("bandwidth_gbps", "latency_us"), required=("bandwidth_gbps",))
    try:
        return LinkSpec(**{**item, "between": tuple(between)})
    except ConfigError as err:
        raise err.located(prefix=path) from None


def _emulation(raw: object) -> dict[str, IslandEmulation]:
    block = as_mapping(raw, "emulation", example="{fast: {slowdown: 1.0}, slow: {slowdown: 2.0}}")
    out: dict[str, IslandEmulation] = {}
    for name, settings in block.items():
        path = join("emulation", str(name))
        item = as_mapping(settings, path, example="{slowdown: 1.5}")
        check_keys(item, path, allowed=("slowdown", "clock"), required=("slowdown",))
        try:
            out[name] = IslandEmulation(**item)
        except ConfigError as err:
            raise err.located(prefix=path) from None
    return out


_MODEL_MARKS = ("num_layers", "hidden_size")  # keys only a model file has
_CLUSTER_MARKS = ("islands", "links", "default_link")  # keys only a cluster file has


def _check_not_swapped(top: dict, *, expected: str) -> None:
    """A model file read as a cluster file (or the reverse) is named as such, rather than by its first
    unknown key: the usual cause is --cluster and --model given the other's file."""
    mine, other = (_CLUSTER_MARKS, _MODEL_MARKS) if expected == "cluster" else (_MODEL_MARKS, _CLUSTER_MARKS)
    found = [k for k in other if k in top]
    if found and not any(k in top for k in mine):
        kind = "model" if expected == "cluster" else "cluster"
        raise ConfigError(f"this looks like a {kind} file, not a {expected} file: did you swap --cluster and "
                          f"--model?", field=found[0], value=top[found[0]] if kind == "model" else "...",
                          fix="pass the cluster YAML as --cluster and the model YAML as --model (tools/cluster.py: "
                              "'show' reads a cluster file, 'model' a model file)")


def cluster_from_dict(data: object, *, source: str | None = None) -> ClusterSpec:
    """Build a validated ClusterSpec from parsed YAML; ``source`` names the file in errors."""
    try:
        top = as_mapping(data, TOP, example="islands: [...]")
        _check_not_swapped(top, expected="cluster")
        check_keys(top, "", allowed=_CLUSTER_KEYS, required=("islands",))
        devices = resolve_device_types(top["device_types"]) if "device_types" in top else dict(CATALOG)
        raw_islands = as_list(top["islands"], "islands", example="[{name: a100-pod, device: A100-80GB, ...}]")
        islands = tuple(_island(raw, i, devices) for i, raw in enumerate(raw_islands))
        raw_links = as_list(top.get("links", []) or [], "links", example="[{between: [a, b], bandwidth_gbps: 100}]")
        links = [_link(raw, join("links", i)) for i, raw in enumerate(raw_links)]
        if "default_link" in top:
            linked = {frozenset(link.between) for link in links}
            names = dict.fromkeys(island.name for island in islands)  # ordered, unique
            for a, b in itertools.combinations(names, 2):
                if frozenset((a, b)) not in linked:
                    links.append(_link(top["default_link"], "default_link", between=(a, b)))
        emulation = _emulation(top["emulation"]) if top.get("emulation") is not None else {}
        return ClusterSpec(islands=islands, links=tuple(links), emulation=emulation, source=source)
    except ConfigError as err:
        raise err.located(file=source) from None


def load_cluster(path: str | os.PathLike[str]) -> ClusterSpec:
    """Read and validate a cluster YAML file (format: docs/cluster-format.md)."""
    return cluster_from_dict(read_yaml(path), source=str(path))


def model_from_dict(data: object, *, source: str | None = None) -> ModelSpec:
    """Build a validated ModelSpec from parsed YAML; ``source`` names the file in errors."""
    try:
        top = as_mapping(data, TOP, example="num_layers: 24")
        _check_not_swapped(top, expected="model")
        check_keys(top, "", allowed=_MODEL_KEYS, required=_MODEL_REQUIRED)
        return ModelSpec(**top)
    except ConfigError as err:
        raise err.located(file=source) from None


def load_model(path: str | os.PathLike[str]) -> ModelSpec:
    """Read and validate a model YAML file (format: docs/cluster-format.md)."""
    return model_from_dict(read_yaml(path), source=str(path))
