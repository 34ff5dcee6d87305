"""Measured per-layer times: the profile file format, its loader, and lookup by layer shape.

Format (JSON, written by ``tools/profile_host.py``)::

    {"format": "megatron-het-profile", "version": 1,
     "device": "CPU",                       # catalog name of the device type measured
     "method": "megatron-core TransformerLayer (local spec), ...",   # how it was measured
     "machine": {...},                      # free-form facts about the host (cpu, torch version)
     "entries": [{"hidden_size": 256, "num_attention_heads": 4, "ffn_hidden_size": 1024,
                  "seq_length": 128, "micro_batch_size": 2, "tp": 1,
                  "forward_s": 0.0012, "backward_s": 0.0025, "peak_memory_bytes": 12345678,
                  "num_query_groups": 4, "swiglu": false, "includes_tp_comm": false}]}   # last three optional

``num_query_groups`` defaults to ``num_attention_heads``, ``swiglu`` and ``includes_tp_comm`` to
false (true: measured on ``tp`` ranks together, the times include the TP collectives). Times are the
median wall time of one layer's forward (backward) for one micro-batch; ``peak_memory_bytes`` is
parameters plus the tensors autograd saved for backward.

Optional sections (``tools/profile_host.py --vocab-size``, ``--optimizer``, ``--comm-ranks``)::

     "parts": [{"part": "embedding", "hidden_size": 256, "vocab_size": 1024, "seq_length": 128,
                "micro_batch_size": 2, "tp": 1, "forward_s": 0.0004, "backward_s": 0.0009}],
                                            # "output": final norm + logits GEMM + cross entropy
     "optimizer": {"seconds_per_parameter": 5e-9, "method": "torch.optim.AdamW ..."},
     "communication": {"ranks": 2, "latency_us": 120.0, "bandwidth_gbps": 8.0, "method": "...",
                       "samples": [{"op": "all_reduce", "bytes": 65536, "seconds": 0.0004}]}
     "compute_model": {"16bit": {"gemm_efficiency": 0.8, "attention_efficiency": 0.5,
                                 "kernel_overhead_us": 6.0, ...}, "method": "tools/calibrate.py ..."}

``"precision": "fp32"`` (or ``"bf16"``, ``"fp16"``; ``tools/profile_host.py --dtype``) records the dtype the
entries and parts were timed in; ``perf.predict`` refuses to price a plan of another precision with
them (fp32 times also price tf32 plans: both train in fp32 storage). Profiles without the key are not
checked. ``"island": "slow"`` says the times stand for that island's devices only (an emulated island
measured as it runs, profiling.host); a profile without it stands for every island of its device type.

``compute_model`` holds the analytic compute model's kernel figures for this device type per
precision class ("fp32", "tf32", "16bit", "fp8"), as tools/calibrate.py fits them from published
runs (megatron_het.perf.compute.ComputeParams); a profile with it may have no layer entries.

``communication`` is one alpha-beta channel fitted to measured gloo/NCCL all-reduces and
send/recv between processes of this host: :func:`megatron_het.perf.calibrate.with_measured_links`
puts it in place of the cluster file's figures for the links it stands for.
"""

from __future__ import annotations

import json
import math
import types
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from megatron_het.cluster import ConfigError, ModelSpec
from megatron_het.cluster.fields import as_bool, as_float, as_int, as_list, as_mapping, as_str, check_keys, join
from megatron_het.perf.kernels import PRECISION_CLASSES, ComputeParams
from megatron_het.plan.types import TRAINS_IN
from megatron_het.utils.atomic import write_text_atomic

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "MEASURED_PRECISIONS",
    "TRAINS_IN",
    "check_profile_precision",
    "layer_shape",
    "ProfileEntry",
    "PartEntry",
    "MeasuredLink",
    "PART_NAMES",
    "Profile",
    "profile_from_dict",
    "profile_to_dict",
    "load_profile",
    "save_profile",
    "lookup",
    "lookup_part",
]

PROFILE_FORMAT = "megatron-het-profile"
PROFILE_VERSION = 1
# a profile's times must have been taken in the dtype the plan trains in (TRAINS_IN, plan/types.py:
# tf32 plans train in fp32 storage)
MEASURED_PRECISIONS = ("fp32", "bf16", "fp16")  # what a profile's "precision" may say
_DTYPE_FLAG = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # tools/profile_host.py --dtype

_MOE_KEYS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size")  # 0 (left out of the file): a dense layer
_SHARED_KEY = "moe_shared_expert_intermediate_size"  # 0 (left out): no shared expert
_DISPATCHER_KEY = "moe_token_dispatcher_type"  # an MoE entry's dispatcher, required ("" left out: dense)
_DISPATCHERS = ("allgather", "alltoall")
_SHAPE_KEYS = ("hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "swiglu",
               "seq_length", "tp") + _MOE_KEYS + (_SHARED_KEY, "ep", _DISPATCHER_KEY)
_INT_KEYS = ("hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "micro_batch_size", "tp",
             "peak_memory_bytes")
_ENTRY_REQUIRED = _INT_KEYS + ("forward_s", "backward_s")
_ENTRY_ALLOWED = (_ENTRY_REQUIRED + ("num_query_groups", "swiglu", "includes_tp_comm", _SHARED_KEY, "ep",
                                     _DISPATCHER_KEY) + _MOE_KEYS)
PART_NAMES = ("embedding", "output")
_PART_INT_KEYS = ("hidden_size", "vocab_size", "seq_length", "micro_batch_size", "tp")
_PART_KEYS = ("part",) + _PART_INT_KEYS + ("forward_s", "backward_s")
_COMM_OPS = ("all_reduce", "send_recv")
# entry fields left out of the file at these values (dense, single-process entries read as before)
_DEFAULTS = {"includes_tp_comm": False, **dict.fromkeys(_MOE_KEYS, 0), _SHARED_KEY: 0, "ep": 1, _DISPATCHER_KEY: ""}
_KEEP = object()  # never equal to a value: every other field is written


@dataclass(frozen=True, kw_only=True)
class ProfileEntry:
    """One measurement: one layer shape at one micro-batch size."""

    hidden_size: int  # h of the measured layer
    num_attention_heads: int  # query heads
    num_query_groups: int  # key/value heads (equal to num_attention_heads without GQA)
    ffn_hidden_size: int  # MLP width
    swiglu: bool  # gated MLP (fc1 twice as wide)
    seq_length: int  # tokens per sample
    micro_batch_size: int  # samples per micro-batch
    tp: int  # tensor-parallel size the layer was split over (1 for single-process profiles)
    forward_s: float  # median forward wall time, seconds
    backward_s: float  # median backward wall time, seconds
    peak_memory_bytes: int  # parameters + saved-for-backward tensors, bytes
    # True when measured on tp ranks together: the times include the layer's TP collectives on the
    # measuring host, so the model must not add its own TP traffic on top.
    includes_tp_comm: bool = False
    # An MoE layer (megatron-core's MoE layer, experts as SequentialMLP, expert parallelism 1; at tp > 1
    # sequence parallel, the experts split over the TP ranks, as the run builds it): its
    # experts, how many each token runs, and their width; 0: a dense layer. Part of the shape, so a
    # dense measurement never prices an MoE layer of the same hidden and FFN sizes, nor the reverse.
    num_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_shared_expert_intermediate_size: int = 0  # an MoE layer's shared expert width; 0: none
    # experts spread over this many processes (each holding num_experts / ep, expert-TP 1), measured on
    # them together with their own tokens each: the times include the all-to-all and its waits
    ep: int = 1
    # the MoE layer's token dispatcher ("allgather" or "alltoall": their traffic under TP and EP differs);
    # "" for a dense layer
    moe_token_dispatcher_type: str = ""

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_length

    def shape(self) -> tuple[object, ...]:
        """What must match for this entry to stand for a layer (everything but the batch)."""
        return tuple(getattr(self, k) for k in _SHAPE_KEYS)


@dataclass(frozen=True, kw_only=True)
class PartEntry:
    """One measurement of a stage's non-layer part at one micro-batch size."""

    part: str  # "embedding" (first stage) or "output" (last stage: final norm, logits GEMM, cross entropy)
    hidden_size: int  # h
    vocab_size: int  # the (padded) vocabulary of the measured part
    seq_length: int  # tokens per sample
    micro_batch_size: int  # samples per micro-batch
    tp: int  # tensor-parallel size the part was split over
    forward_s: float  # median forward wall time, seconds
    backward_s: float  # median backward wall time, seconds

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_length


@dataclass(frozen=True, kw_only=True)
class MeasuredLink:
    """An alpha-beta channel fitted to collectives measured between processes of one host."""

    ranks: int  # processes the collectives ran over
    latency_us: float  # alpha: per message / ring step, microseconds
    bandwidth_gbps: float  # 1/beta: per rank, one direction, Gbit/s
    method: str  # backend and fit, e.g. "gloo, least squares on all_reduce and send_recv"
    samples: tuple[tuple[str, int, float], ...] = ()  # (op, bytes, median seconds) the fit used


@dataclass(frozen=True, kw_only=True)
class Profile:
    """A set of measurements taken on one device type."""

    device: str  # device type name the entries were measured on, e.g. "CPU"
    entries: tuple[ProfileEntry, ...]  # at least one
    method: str  # how the times were measured (which layer implementation, repeats)
    machine: Mapping[str, Any] = field(default_factory=lambda: types.MappingProxyType({}))  # host facts
    source: str | None = None  # file it was loaded from
    parts: tuple[PartEntry, ...] = ()  # embedding / output measurements; empty: analytic model
    optimizer_s_per_parameter: float | None = None  # measured AdamW step per parameter; None: analytic
    optimizer_method: str = ""  # how the optimizer step was measured
    link: MeasuredLink | None = None  # measured communication of this host; None: the cluster file's figures
    # precision class -> megatron_het.perf.compute.ComputeParams fitted for this device type (tools/calibrate.py)
    compute_model: Mapping[str, Any] = field(default_factory=dict)  # (a dict: profiles cross process boundaries)
    compute_method: str = ""  # how compute_model was obtained
    # measured split backward (zero-bubble B and W) of the same layers, each as a share of their fused
    # backward: (input-gradient share, weight-gradient share); None: the model assumes half each
    backward_split: tuple[float, float] | None = None
    backward_split_method: str = ""  # how backward_split was measured
    # measured fixed cost of one call of a model chunk (one pipeline action), beyond its layers: (forward,
    # backward) seconds, the intercept of a chunk's time vs its layer count; the entries' per-layer times
    # were measured on stacks of ``call_overhead_layers`` layers, so each already holds 1/that of it.
    # None: the model charges nothing per call (a chunk costs its layers only)
    call_overhead: tuple[float, float] | None = None
    call_overhead_layers: int = 1  # layers of the stacks the entries were measured on (with call_overhead)
    call_overhead_method: str = ""  # how call_overhead was measured
    # the precision the entries and parts were timed in ("fp32" or "bf16": tools/profile_host.py --dtype);
    # None: not recorded (profiles written before it). perf.predict refuses to price a plan of another
    # precision with these times (a bf16 plan on a CPU profile timed in fp32 trains ~10x slower here).
    precision: str | None = None
    # the island whose devices these times stand for (None: every island of ``device``). An island's own
    # profile wins over the device type's (perf.predict.profile_for): CPU ranks emulating two devices on
    # one host wait differently between actions, and their caches are colder the longer they wait
    # (profiling.host measures one profile per emulated island).
    island: str | None = None


def _entry_from_dict(data: object, path: str) -> ProfileEntry:
    data = as_mapping(data, path, example='{"hidden_size": 256, ...}')
    check_keys(data, path, allowed=_ENTRY_ALLOWED, required=_ENTRY_REQUIRED)
    ints = {k: as_int(data[k], join(path, k)) for k in _INT_KEYS}
    heads = ints["num_attention_heads"]
    groups = as_int(data.get("num_query_groups", heads), join(path, "num_query_groups"))
    if heads % groups:
        raise ConfigError(f"num_attention_heads {heads} is not divisible by it", field=join(path, "num_query_groups"),
                          value=groups, fix="record the key/value head count of the measured layer")
    return ProfileEntry(
        **ints,
        num_query_groups=groups,
        swiglu=as_bool(data.get("swiglu", False), join(path, "swiglu")),
        includes_tp_comm=as_bool(data.get("includes_tp_comm", False), join(path, "includes_tp_comm")),
        **_moe_shape(data, path),
        forward_s=as_float(data["forward_s"], join(path, "forward_s")),
        backward_s=as_float(data["backward_s"], join(path, "backward_s")),
    )


def _moe_shape(data: Mapping[str, object], path: str) -> dict[str, int]:
    """An entry's MoE keys: none (a dense layer) or all three (and the shared expert's width, if it has
    one, and the expert-parallel size, if > 1), top-k within the experts."""
    given = [k for k in _MOE_KEYS if k in data]
    if not given:
        for key, what in ((_SHARED_KEY, "a shared expert"), ("ep", "expert parallelism"), (_DISPATCHER_KEY, "a dispatcher")):
            if key in data:
                raise ConfigError(f"{what} without the MoE keys", field=join(path, key), value=data[key],
                                  fix=f"record {', '.join(_MOE_KEYS)} of the measured layer")
        return {}
    if len(given) != len(_MOE_KEYS) or _DISPATCHER_KEY not in data:
        missing = [k for k in (*_MOE_KEYS, _DISPATCHER_KEY) if k not in data]
        raise ConfigError(f"an MoE entry needs {', '.join((*_MOE_KEYS, _DISPATCHER_KEY))}; {', '.join(missing)} missing",
                          field=join(path, missing[0]), value=None,
                          fix="regenerate the profile with tools/profile_host.py --num-experts ...")
    out = {k: as_int(data[k], join(path, k)) for k in _MOE_KEYS}
    for key in (_SHARED_KEY, "ep"):
        if key in data:
            out[key] = as_int(data[key], join(path, key))
    out[_DISPATCHER_KEY] = as_str(data[_DISPATCHER_KEY], join(path, _DISPATCHER_KEY))
    if out[_DISPATCHER_KEY] not in _DISPATCHERS:
        raise ConfigError(f"unknown dispatcher (known: {', '.join(_DISPATCHERS)})", field=join(path, _DISPATCHER_KEY),
                          value=out[_DISPATCHER_KEY], fix="regenerate the profile with tools/profile_host.py")
    if out["num_experts"] % out.get("ep", 1):
        raise ConfigError(f"does not divide num_experts {out['num_experts']}", field=join(path, "ep"),
                          value=out["ep"], fix="record the expert-parallel size the layer was measured over")
    if out["moe_router_topk"] > out["num_experts"]:
        raise ConfigError(f"exceeds num_experts {out['num_experts']}", field=join(path, "moe_router_topk"),
                          value=out["moe_router_topk"], fix="record the measured layer's router top-k")
    return out


def layer_shape(model: ModelSpec) -> dict[str, object]:
    """``lookup``'s shape keywords of one of ``model``'s layers (but seq_length and tp): an MoE model's
    layers are its MoE layers (perf.flops prices every layer of an MoE model as one)."""
    moe = dict(num_experts=model.num_experts, moe_router_topk=model.moe_router_topk,
               moe_ffn_hidden_size=model.moe_ffn_hidden_size,
               moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size or 0,
               moe_token_dispatcher_type=model.moe_token_dispatcher_type) if model.is_moe else {}
    return dict(hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
                num_query_groups=model.num_query_groups, ffn_hidden_size=model.ffn_hidden_size, swiglu=model.swiglu,
                **moe)


def _part_from_dict(data: object, path: str) -> PartEntry:
    data = as_mapping(data, path, example='{"part": "embedding", "hidden_size": 256, ...}')
    check_keys(data, path, allowed=_PART_KEYS, required=_PART_KEYS)
    part = as_str(data["part"], join(path, "part"))
    if part not in PART_NAMES:
        raise ConfigError(f"unknown part (known: {', '.join(PART_NAMES)})", field=join(path, "part"), value=part,
                          fix="regenerate the profile with tools/profile_host.py")
    return PartEntry(part=part, **{k: as_int(data[k], join(path, k)) for k in _PART_INT_KEYS},
                     forward_s=as_float(data["forward_s"], join(path, "forward_s")),
                     backward_s=as_float(data["backward_s"], join(path, "backward_s")))


def _link_from_dict(data: object, path: str) -> MeasuredLink:
    data = as_mapping(data, path, example='{"ranks": 2, "latency_us": 100, "bandwidth_gbps": 8}')
    check_keys(data, path, allowed=("ranks", "latency_us", "bandwidth_gbps", "method", "samples"),
               required=("ranks", "latency_us", "bandwidth_gbps"))
    samples = []
    for i, item in enumerate(as_list(data.get("samples", []), join(path, "samples"), example="[]")):
        sp = join(join(path, "samples"), i)
        item = as_mapping(item, sp, example='{"op": "all_reduce", "bytes": 65536, "seconds": 0.001}')
        check_keys(item, sp, allowed=("op", "bytes", "seconds"), required=("op", "bytes", "seconds"))
        op = as_str(item["op"], join(sp, "op"))
        if op not in _COMM_OPS:
            raise ConfigError(f"unknown operation (known: {', '.join(_COMM_OPS)})", field=join(sp, "op"), value=op,
                              fix="regenerate the profile with tools/profile_host.py")
        samples.append((op, as_int(item["bytes"], join(sp, "bytes")), as_float(item["seconds"], join(sp, "seconds"))))
    return MeasuredLink(ranks=as_int(data["ranks"], join(path, "ranks")),
                        latency_us=as_float(data["latency_us"], join(path, "latency_us"), inclusive=True),
                        bandwidth_gbps=as_float(data["bandwidth_gbps"], join(path, "bandwidth_gbps")),
                        method=as_str(data.get("method", "unspecified"), join(path, "method")),
                        samples=tuple(samples))


def profile_from_dict(data: object, *, source: str | None = None) -> Profile:
    """Validate a parsed profile; errors are :class:`ConfigError` naming the file and field."""
    try:
        data = as_mapping(data, "(top level)", example='{"format": "megatron-het-profile", ...}')
        check_keys(data, "", allowed=("format", "version", "device", "method", "machine", "entries", "parts",
                                      "optimizer", "communication", "compute_model", "backward_split",
                                      "call_overhead", "precision", "island"),
                   required=("format", "version", "device", "entries"))
        if data["format"] != PROFILE_FORMAT:
            raise ConfigError("not a megatron-het profile", field="format", value=data["format"],
                              fix=f"set \"format\": \"{PROFILE_FORMAT}\" or regenerate it with tools/profile_host.py")
        if data["version"] != PROFILE_VERSION:
            raise ConfigError(f"unsupported version (this code reads {PROFILE_VERSION})", field="version",
                              value=data["version"], fix="regenerate the profile with tools/profile_host.py")
        raw = as_list(data["entries"], "entries", example='[{"hidden_size": 256, ...}]')
        compute_model, compute_method = _compute_model_from_dict(data.get("compute_model"))
        if not raw and not compute_model:
            raise ConfigError("a profile needs at least one entry", field="entries", value=raw,
                              fix="regenerate the profile with tools/profile_host.py")
        entries = tuple(_entry_from_dict(e, join("entries", i)) for i, e in enumerate(raw))
        seen: dict[tuple[object, ...], int] = {}
        for i, e in enumerate(entries):
            key = e.shape() + (e.micro_batch_size,)
            if key in seen:
                raise ConfigError(f"duplicate measurement (also entries[{seen[key]}])", field=f"entries[{i}]",
                                  value=e.micro_batch_size, fix="keep one entry per layer shape and micro-batch size")
            seen[key] = i
        machine = as_mapping(data.get("machine", {}), "machine", example='{"cpu": "..."}')
        parts = tuple(_part_from_dict(p, join("parts", i))
                      for i, p in enumerate(as_list(data.get("parts", []), "parts", example="[]")))
        seen_parts: set[tuple[object, ...]] = set()
        for i, p in enumerate(parts):
            key = (p.part, p.hidden_size, p.vocab_size, p.seq_length, p.tp, p.micro_batch_size)
            if key in seen_parts:
                raise ConfigError("duplicate measurement", field=f"parts[{i}]", value=p.part,
                                  fix="keep one entry per part, shape and micro-batch size")
            seen_parts.add(key)
        opt_s, opt_method = None, ""
        if "optimizer" in data:
            opt = as_mapping(data["optimizer"], "optimizer", example='{"seconds_per_parameter": 5e-9}')
            check_keys(opt, "optimizer", allowed=("seconds_per_parameter", "method"),
                       required=("seconds_per_parameter",))
            opt_s = as_float(opt["seconds_per_parameter"], "optimizer.seconds_per_parameter")
            opt_method = as_str(opt.get("method", "unspecified"), "optimizer.method")
        link = _link_from_dict(data["communication"], "communication") if "communication" in data else None
        split, split_method = None, ""
        if "backward_split" in data:
            raw_split = as_mapping(data["backward_split"], "backward_split",
                                   example='{"input_share": 0.55, "weight_share": 0.5}')
            check_keys(raw_split, "backward_split", allowed=("input_share", "weight_share", "method"),
                       required=("input_share", "weight_share"))
            split = tuple(as_float(raw_split[k], f"backward_split.{k}") for k in ("input_share", "weight_share"))
            if not all(0.0 < x < 2.0 for x in split):
                raise ConfigError("shares of the fused backward must be in (0, 2)", field="backward_split",
                                  value=list(split), fix="regenerate the profile with tools/profile_host.py")
            split_method = as_str(raw_split.get("method", "unspecified"), "backward_split.method")
        overhead, overhead_layers, overhead_method = None, 1, ""
        if "call_overhead" in data:
            raw = as_mapping(data["call_overhead"], "call_overhead",
                             example='{"forward_s": 0.0008, "backward_s": 0.0005, "stack_layers": 2}')
            check_keys(raw, "call_overhead", allowed=("forward_s", "backward_s", "stack_layers", "method"),
                       required=("forward_s", "backward_s", "stack_layers"))
            # a measured intercept: noise can make it negative (the model then charges nothing per call)
            overhead = tuple(as_float(raw[k], f"call_overhead.{k}", minimum=-math.inf)
                             for k in ("forward_s", "backward_s"))
            overhead_layers = as_int(raw["stack_layers"], "call_overhead.stack_layers")
            if overhead_layers < 2:
                raise ConfigError("an intercept needs the entries measured on stacks of >= 2 layers",
                                  field="call_overhead.stack_layers", value=overhead_layers,
                                  fix="regenerate the profile with tools/profile_host.py --call-overhead --num-layers 2")
            overhead_method = as_str(raw.get("method", "unspecified"), "call_overhead.method")
        precision = data.get("precision")
        if precision is not None and precision not in MEASURED_PRECISIONS:
            raise ConfigError("unknown measured precision", field="precision", value=precision,
                              fix=f"use one of {', '.join(MEASURED_PRECISIONS)}, or remove the key")
        island = data.get("island")
        return Profile(precision=precision, island=None if island is None else as_str(island, "island"),
                       device=as_str(data["device"], "device"), entries=entries,
                       method=as_str(data.get("method", "unspecified"), "method"),
                       machine=types.MappingProxyType(dict(machine)), source=source, parts=parts,
                       optimizer_s_per_parameter=opt_s, optimizer_method=opt_method, link=link,
                       compute_model=dict(compute_model), compute_method=compute_method,
                       backward_split=split, backward_split_method=split_method, call_overhead=overhead,
                       call_overhead_layers=overhead_layers, call_overhead_method=overhead_method)
    except ConfigError as err:
        raise err.located(file=source) from None


def _compute_model_from_dict(data: object) -> tuple[dict[str, Any], str]:
    if data is None:
        return {}, ""
    data = as_mapping(data, "compute_model", example='{"16bit": {"gemm_efficiency": 0.8, ...}}')
    check_keys(data, "compute_model", allowed=PRECISION_CLASSES + ("method",), required=())
    out = {}
    keys = ("gemm_efficiency", "attention_efficiency", "kernel_overhead_us", "memory_efficiency", "k_half",
            "elementwise_kernels", "source", "fused_norm_casts")
    for cls in PRECISION_CLASSES:
        if cls not in data:
            continue
        path = join("compute_model", cls)
        item = as_mapping(data[cls], path, example='{"gemm_efficiency": 0.8, "kernel_overhead_us": 6}')
        check_keys(item, path, allowed=keys, required=("gemm_efficiency", "attention_efficiency",
                                                       "kernel_overhead_us"))
        kwargs: dict[str, Any] = {k: as_float(item[k], join(path, k)) for k in keys[:5] if k in item}
        if "kernel_overhead_us" in item:
            kwargs["kernel_overhead_us"] = as_float(item["kernel_overhead_us"], join(path, "kernel_overhead_us"),
                                                    inclusive=True)
        if "fused_norm_casts" in item:
            kwargs["fused_norm_casts"] = as_bool(item["fused_norm_casts"], join(path, "fused_norm_casts"))
        if "elementwise_kernels" in item:
            kwargs["elementwise_kernels"] = as_int(item["elementwise_kernels"], join(path, "elementwise_kernels"))
        kwargs["source"] = as_str(item.get("source", "profile"), join(path, "source"))
        try:
            out[cls] = ComputeParams(**kwargs)
        except ConfigError as err:
            raise err.located(prefix=path) from None
    return out, as_str(data.get("method", ""), "compute_model.method")


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    out: dict[str, Any] = {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "device": profile.device,
        "method": profile.method,
        "machine": dict(profile.machine),
        "entries": [{k: v for k, v in asdict(e).items() if _DEFAULTS.get(k, _KEEP) != v} for e in profile.entries],
    }
    if profile.parts:
        out["parts"] = [asdict(p) for p in profile.parts]
    if profile.optimizer_s_per_parameter is not None:
        out["optimizer"] = {"seconds_per_parameter": profile.optimizer_s_per_parameter,
                            "method": profile.optimizer_method}
    if profile.link is not None:
        link = profile.link
        out["communication"] = {"ranks": link.ranks, "latency_us": link.latency_us,
                                "bandwidth_gbps": link.bandwidth_gbps, "method": link.method,
                                "samples": [{"op": o, "bytes": b, "seconds": t} for o, b, t in link.samples]}
    if profile.backward_split is not None:
        out["backward_split"] = {"input_share": profile.backward_split[0], "weight_share": profile.backward_split[1],
                                 "method": profile.backward_split_method}
    if profile.call_overhead is not None:
        out["call_overhead"] = {"forward_s": profile.call_overhead[0], "backward_s": profile.call_overhead[1],
                                "stack_layers": profile.call_overhead_layers, "method": profile.call_overhead_method}
    if profile.precision is not None:
        out["precision"] = profile.precision
    if profile.island is not None:
        out["island"] = profile.island
    if profile.compute_model:
        out["compute_model"] = {cls: p.to_dict() for cls, p in profile.compute_model.items()}
        out["compute_model"]["method"] = profile.compute_method
    return out


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file; every unreadable or malformed file is one ConfigError naming it."""
    path = Path(path)
    fix = "pass the JSON written by tools/profile_host.py"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("file not found", field="profile", value=str(path), fix=fix, file=str(path)) from None
    except IsADirectoryError:
        raise ConfigError("is a directory", field="profile", value=str(path), fix=fix, file=str(path)) from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"not UTF-8 text (byte {err.start})", field="profile", value=str(path), fix=fix,
                          file=str(path)) from None
    except OSError as err:
        raise ConfigError(f"cannot read the file ({err.strerror})", field="profile", value=str(path), fix=fix,
                          file=str(path)) from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"not valid JSON ({err.msg} at line {err.lineno})", field="profile", value=str(path),
                          fix="regenerate the profile with tools/profile_host.py", file=str(path)) from None
    except RecursionError:
        raise ConfigError("JSON nested too deeply to be a profile", field="profile", value=str(path), fix=fix,
                          file=str(path)) from None
    return profile_from_dict(data, source=str(path))


def save_profile(profile: Profile, path: str | Path) -> None:
    """Atomic write (utils/atomic.py): an existing profile is replaced whole or not at all."""
    write_text_atomic(path, json.dumps(profile_to_dict(profile), indent=2) + "\n")


def lookup(profile: Profile, *, hidden_size: int, num_attention_heads: int, ffn_hidden_size: int, seq_length: int,
           micro_batch_size: int, tp: int = 1, num_query_groups: int | None = None,
           swiglu: bool = False, num_experts: int = 0, moe_router_topk: int = 0,
           moe_ffn_hidden_size: int = 0, moe_shared_expert_intermediate_size: int = 0,
           ep: int = 1, moe_token_dispatcher_type: str = "") -> ProfileEntry | None:
    """Times for this layer shape at ``micro_batch_size``, or None when the shape was not measured.

    Values are interpolated linearly in tokens (micro_batch_size * seq_length) between the two
    measurements around the request. Outside the measured range the line through the two nearest
    measurements is extended, but never below the nearest measurement scaled in proportion to
    tokens (which keeps small-batch extrapolations positive); a single measurement is scaled in
    proportion. Returns an entry at the requested micro-batch size.
    """
    shape = (hidden_size, num_attention_heads, num_query_groups or num_attention_heads, ffn_hidden_size, swiglu,
             seq_length, tp, num_experts, moe_router_topk, moe_ffn_hidden_size, moe_shared_expert_intermediate_size, ep,
             moe_token_dispatcher_type)
    points = sorted((e for e in profile.entries if e.shape() == shape), key=lambda e: e.tokens)
    if not points:
        return None
    tokens = micro_batch_size * seq_length
    if len(points) == 1:
        lo = hi = points[0]
    else:
        i = sum(1 for e in points[1:-1] if e.tokens <= tokens)  # index of the pair's lower end
        lo, hi = points[i], points[i + 1]
    inside = points[0].tokens <= tokens <= points[-1].tokens
    nearest = points[0] if tokens < points[0].tokens else points[-1]

    def value(name: str) -> float:
        proportional = getattr(nearest, name) * tokens / nearest.tokens
        if lo is hi:
            return proportional
        a, b = getattr(lo, name), getattr(hi, name)
        linear = a + (b - a) * (tokens - lo.tokens) / (hi.tokens - lo.tokens)
        return linear if inside else max(linear, proportional)

    return replace(lo, micro_batch_size=micro_batch_size, forward_s=value("forward_s"),
                   backward_s=value("backward_s"), peak_memory_bytes=round(value("peak_memory_bytes")))


def lookup_part(profile: Profile, part: str, *, hidden_size: int, vocab_size: int, seq_length: int,
                micro_batch_size: int, tp: int = 1) -> PartEntry | None:
    """Measured ``part`` for this shape, interpolated in tokens like :func:`lookup`; None if not measured."""
    points = sorted((p for p in profile.parts if (p.part, p.hidden_size, p.vocab_size, p.seq_length, p.tp)
                     == (part, hidden_size, vocab_size, seq_length, tp)), key=lambda p: p.tokens)
    if not points:
        return None
    tokens = micro_batch_size * seq_length
    below = [p for p in points if p.tokens <= tokens]
    above = [p for p in points if p.tokens >= tokens]
    if below and above:
        lo, hi = below[-1], above[0]
        w = 0.0 if hi.tokens == lo.tokens else (tokens - lo.tokens) / (hi.tokens - lo.tokens)
        fwd = lo.forward_s + w * (hi.forward_s - lo.forward_s)
        bwd = lo.backward_s + w * (hi.backward_s - lo.backward_s)
    else:  # outside the measured range: proportional to tokens from the nearest measurement
        near = points[0] if not below else points[-1]
        fwd, bwd = near.forward_s * tokens / near.tokens, near.backward_s * tokens / near.tokens
    return replace(points[0], micro_batch_size=micro_batch_size, forward_s=fwd, backward_s=bwd)


def check_profile_precision(profiles, plan_precision: str, devices) -> None:
    """Raise ConfigError when a profile with measured times for one of ``devices`` was timed in
    another precision than ``plan_precision`` (its times would price the wrong kernels)."""
    for p in profiles:
        if p.precision is None or p.device not in devices or not (p.entries or p.parts):
            continue
        if TRAINS_IN.get(plan_precision) != p.precision:
            raise ConfigError(f"the {p.device} profile{f' ({p.source})' if p.source else ''} was timed in "
                              f"{p.precision}, the plan trains in {plan_precision}", field="plan.precision",
                              value=plan_precision,
                              fix=f"price and train the plan at {p.precision} (tools/plan.py --precision "
                                  f"{p.precision}), or time the profile in {plan_precision} (tools/profile_host.py "
                                  f"--dtype {_DTYPE_FLAG.get(TRAINS_IN.get(plan_precision), plan_precision)})")
