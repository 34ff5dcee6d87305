"""Published training runs (examples/published/*.yaml) as plans the predictor prices.

Each file is one source: its citation (``title``, ``url``, ``where``), the published figure's kind
(``metric``: ``tokens_per_s_per_gpu``, ``tflops_per_gpu``, or ``seconds_per_iteration`` when the source
gives step times; ``flops: hardware`` when the TFLOP/s
count the recomputed forward, as Narayanan et al. 2021's Eq. 3 does), the machine (``cluster``:
device type, GPUs per node, inter-node Gbit/s per GPU), ``defaults`` for its rows, optional named
``models`` and ``assumed`` (what the source does not state and the row takes as given), and ``rows``.
A row: ``id``, ``where`` (table and row in the source), ``model`` (a name from ``models``, a file of
examples/models/ without ``.yaml``, or a mapping of ModelSpec fields), ``tp``, ``pp``, ``gpus``,
``micro_batch_size``, ``global_batch_size``, optional ``virtual_pipeline_size``, ``precision``,
``seq_length``, ``recompute`` (none | selective | full), ``recompute_num_layers`` (with ``full``: only the
first N layers of each stage recompute, Megatron's block method; a layer-level policy recomputing every
k-th layer costs the same time with N = its count per stage), ``flash_attention``, ``attention_kernel`` (the
fused attention's design on H100: ``hopper`` for FlashAttention-3 or cuDNN 9's fused attention, which
Transformer Engine runs; ``fa2``, the default, for FlashAttention-2 or kernels of its generation),
``fused_norm_casts`` (fp8 runs: the norms before QKV and fc1 write fp8, as megatron-core's Transformer
Engine spec does, the default; false when every linear is a separate te.Linear casting its input), ``sequence_parallel``,
``tp_comm_overlap``, ``distributed_optimizer``, ``overlap_grad_reduce``, ``group`` (rows comparing
configurations of one model, whose ordering the predictor must reproduce), ``cluster`` overrides, and
``published`` (the figure, in the file's ``metric``).

Fully sharded data parallelism (FSDP) rows are priced as data-parallel replicas with the
distributed optimizer and an overlapped gradient reduction (their weight all-gathers taken as
hidden behind compute): the files say so in ``assumed``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megatron_het.cluster import ClusterSpec, ConfigError, ModelSpec, cluster_from_dict, load_model, read_yaml
from megatron_het.perf.flops import model_flops_per_iteration
from megatron_het.perf.predict import Prediction, predict
from megatron_het.perf.profile import Profile
from megatron_het.plan import Plan, homogeneous_plan

__all__ = ["PublishedRow", "load_published", "predict_row", "DEFAULT_DIR"]

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / "examples" / "published"
_MODELS_DIR = ROOT / "examples" / "models"


@dataclass(frozen=True, kw_only=True)
class PublishedRow:
    """One published run, ready to price."""

    source: str  # the file's source key, e.g. "narayanan2021"
    id: str  # row id, unique within its source
    where: str  # table and row in the source
    url: str  # the source's address
    device: str  # device type name
    precision: str
    model: ModelSpec
    cluster: ClusterSpec
    plan: Plan
    recompute: str  # none | selective | full
    flash_attention: bool
    overlap_grad_reduce: bool
    attention_kernel: str  # fused attention design: "hopper" (FlashAttention-3, cuDNN 9) or "fa2"
    fused_norm_casts: bool  # fp8: the norms write fp8 for QKV and fc1 (TE LayerNormLinear); False: te.Linear casts
    metric: str  # tokens_per_s_per_gpu | tflops_per_gpu | seconds_per_iteration
    published: float  # the figure as published, in ``metric``
    published_iteration_s: float  # the same figure as seconds per iteration
    group: str | None = None  # rows comparing configurations of one model
    gpus: int = 1
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.source}/{self.id}"


def _model(spec: object, models: Mapping[str, Any], overrides: Mapping[str, Any], where: str) -> ModelSpec:
    if isinstance(spec, str):
        if spec in models:
            fields = dict(models[spec])
        else:
            path = _MODELS_DIR / f"{spec}.yaml"
            if not path.exists():
                raise ConfigError("unknown model name", field=f"{where}.model", value=spec,
                                  fix="name a model of the file's 'models' or of examples/models/")
            base = load_model(path)
            fields = {k: getattr(base, k) for k in ModelSpec.__dataclass_fields__}
    elif isinstance(spec, Mapping):
        fields = dict(spec)
    else:
        raise ConfigError("must be a model name or mapping", field=f"{where}.model", value=spec,
                          fix="write e.g. model: llama2-7b or model: {num_layers: 24, ...}")
    for k in ("seq_length", "vocab_size"):
        if k in overrides:
            fields[k] = overrides[k]
    if "seq_length" in overrides:
        fields["max_position_embeddings"] = max(fields.get("max_position_embeddings") or 0, overrides["seq_length"])
    return ModelSpec(**fields)


def _published_iteration_s(metric: str, flops_kind: str, value: float, *, model: ModelSpec, gbs: int, gpus: int,
                           recompute: str) -> float:
    if metric == "tokens_per_s_per_gpu":
        return gbs * model.seq_length / (value * gpus)
    if metric == "seconds_per_iteration":
        return value
    if metric == "tflops_per_gpu":
        mode = recompute if flops_kind == "hardware" else "none"
        return model_flops_per_iteration(model, global_batch_size=gbs, recompute=mode) / (value * 1e12 * gpus)
    raise ConfigError("unknown metric", field="metric", value=metric, fix="use tokens_per_s_per_gpu, tflops_per_gpu or seconds_per_iteration")


def _attention_kernel(value: object, where: str) -> str:
    if value not in ("hopper", "fa2"):
        raise ConfigError("unknown attention kernel", field=f"{where}.attention_kernel", value=value,
                          fix="use hopper (FlashAttention-3, cuDNN 9 fused attention) or fa2 (FlashAttention-2)")
    return str(value)


def _row(data: Mapping[str, Any], raw: Mapping[str, Any], path: str) -> PublishedRow:
    row = {**data.get("defaults", {}), **raw}
    where = f"{path}:{raw.get('id')}"
    model = _model(row["model"], data.get("models", {}), row, where)
    cl = {**data["cluster"], **row.get("cluster", {})}
    tp, pp, gpus = int(row.get("tp", 1)), int(row.get("pp", 1)), int(row["gpus"])
    dp, rem = divmod(gpus, tp * pp)
    if rem or dp < 1:
        raise ConfigError(f"gpus={gpus} is not a multiple of tp*pp={tp * pp}", field=f"{where}.gpus", value=gpus,
                          fix="check the row against its source")
    per_node = int(cl.get("gpus_per_node", 8))
    nodes = max(1, -(-gpus // per_node))
    island = {"name": "published", "device": cl["device"], "nodes": nodes, "gpus_per_node": min(per_node, gpus)}
    if "inter_node_bandwidth_gbps" in cl:
        island["inter_node_bandwidth_gbps"] = cl["inter_node_bandwidth_gbps"]
    cluster = cluster_from_dict({"islands": [island]})
    mbs, gbs = int(row["micro_batch_size"]), int(row["global_batch_size"])
    v = int(row.get("virtual_pipeline_size", 1))
    recompute = row.get("recompute", "none")
    partial = int(row.get("recompute_num_layers", 0))
    if partial and recompute != "full":
        raise ConfigError(f"recompute_num_layers needs recompute: full (the row says {recompute})",
                          field=f"{where}.recompute_num_layers", value=partial,
                          fix="set recompute: full, or remove recompute_num_layers")
    if partial and data.get("flops", "model") == "hardware":  # Eq. 3 counts every layer's recomputed forward
        raise ConfigError("recompute_num_layers cannot convert a hardware-FLOPs figure",
                          field=f"{where}.recompute_num_layers", value=partial,
                          fix="give the row's figure as tokens/s or seconds per iteration, or remove recompute_num_layers")
    plan = homogeneous_plan(tp=tp, pp=pp, dp=dp, num_layers=model.num_layers, micro_batch_size=mbs,
                            global_batch_size=gbs, island="published", device_type=cl["device"])
    overlap_tp = bool(row.get("tp_comm_overlap", False))
    replicas = tuple(replace(r, stages=tuple(replace(s, recompute=recompute != "none", tp_comm_overlap=overlap_tp,
                                                     recompute_num_layers=partial)
                                             for s in r.stages)) for r in plan.replicas)
    plan = replace(plan, replicas=replicas, schedule="interleaved" if v > 1 else "1f1b", virtual_pipeline_size=v,
                   sequence_parallel=bool(row.get("sequence_parallel", False)),
                   use_distributed_optimizer=bool(row.get("distributed_optimizer", False)),
                   precision=row.get("precision", "bf16"))
    metric = data["metric"]
    value = float(row["published"])
    return PublishedRow(
        source=data["source"], id=str(row["id"]), where=str(row.get("where", "")), url=data.get("url", ""),
        device=cl["device"], precision=plan.precision, model=model, cluster=cluster, plan=plan, recompute=recompute,
        flash_attention=bool(row.get("flash_attention", True)),
        attention_kernel=_attention_kernel(row.get("attention_kernel", "fa2"), where),
        fused_norm_casts=bool(row.get("fused_norm_casts", True)),
        overlap_grad_reduce=bool(row.get("overlap_grad_reduce", False)), metric=metric, published=value,
        published_iteration_s=_published_iteration_s(metric, data.get("flops", "model"), value, model=model, gbs=gbs,
                                                      gpus=gpus, recompute=recompute),
        group=row.get("group"), gpus=gpus,
    )


def load_published(directory: str | os.PathLike[str] = DEFAULT_DIR, *,
                   sources: Sequence[str] | None = None) -> list[PublishedRow]:
    """Every row of every ``*.yaml`` in ``directory`` (only ``sources`` when given), in file order."""
    rows: list[PublishedRow] = []
    files = sorted(Path(directory).glob("*.yaml"))
    if not files:
        raise ConfigError("no published data set here", field="data", value=str(directory),
                          fix="pass the folder holding the *.yaml files, e.g. examples/published")
    known = []
    for path in files:
        data = read_yaml(path)
        known.append(data["source"])
        if sources is not None and data["source"] not in sources:
            continue
        try:
            rows.extend(_row(data, raw, path.name) for raw in data["rows"])
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"malformed published row ({err})", field="rows", value=path.name,
                              fix="see the row format in megatron_het/perf/published.py") from None
    if sources is not None:
        unknown = sorted(set(sources) - set(known))
        if unknown:
            raise ConfigError("unknown source", field="sources", value=", ".join(unknown),
                              fix=f"use some of: {', '.join(known)}")
    return rows


def predict_row(row: PublishedRow, *, profile: Profile | Sequence[Profile] | None = None) -> Prediction:
    """The predictor's iteration for a published run."""
    return predict(row.plan, row.model, row.cluster, profile=profile, overlap_grad_reduce=row.overlap_grad_reduce,
                   bucket_all_stages=row.overlap_grad_reduce, flash_attention=row.flash_attention,
                   recompute_mode=row.recompute if row.recompute != "none" else None)
