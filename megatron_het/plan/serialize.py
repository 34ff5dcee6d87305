"""Plan <-> JSON. Shape and type checks only; semantic checks are in validate.py."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

from megatron_het.plan.errors import PlanError
from megatron_het.plan.types import (
    PLAN_FORMAT,
    PLAN_FORMAT_VERSION,
    Plan,
    ReplicaPlan,
    StagePlan,
)
from megatron_het.utils.atomic import write_text_atomic

_PLAN_KEYS = (
    "format",
    "version",
    "micro_batch_size",
    "global_batch_size",
    "schedule",
    "virtual_pipeline_size",
    "sequence_parallel",
    "use_distributed_optimizer",
    "replicas",
    "predicted",
)
_REPLICA_KEYS = ("num_micro_batches", "stages")
_STAGE_KEYS = ("island", "device_type", "ranks", "layers", "recompute", "tp_comm_overlap")


def stage_to_dict(stage: StagePlan) -> dict:
    """JSON-ready dict of one stage (every field, defaults included)."""
    return {
        "island": stage.island,
        "device_type": stage.device_type,
        "ranks": list(stage.ranks),
        "layers": list(stage.layers),
        "recompute": stage.recompute,
        "tp_comm_overlap": stage.tp_comm_overlap,
    }


def plan_to_dict(plan: Plan) -> dict:
    """JSON-ready dict of a plan, with the format and version keys first."""
    predicted = None
    if plan.predicted is not None:
        # Deep copy through JSON: proves it is serializable and detaches it from the plan.
        predicted = json.loads(json.dumps(dict(plan.predicted)))
    return {
        "format": PLAN_FORMAT,
        "version": plan.version,
        "micro_batch_size": plan.micro_batch_size,
        "global_batch_size": plan.global_batch_size,
        "schedule": plan.schedule,
        "virtual_pipeline_size": plan.virtual_pipeline_size,
        "sequence_parallel": plan.sequence_parallel,
        "use_distributed_optimizer": plan.use_distributed_optimizer,
        "replicas": [
            {
                "num_micro_batches": r.num_micro_batches,
                "stages": [stage_to_dict(s) for s in r.stages],
            }
            for r in plan.replicas
        ],
        "predicted": predicted,
    }


# Only structural arrays match: json.dumps escapes newlines inside strings, so "[\n" is never in one.
_NUMBER_LIST = re.compile(r"\[\n\s*(-?\d+(?:,\n\s*-?\d+)*)\n\s*\]")


def plan_to_json(plan: Plan) -> str:
    """Indented JSON text with a trailing newline; integer lists (ranks, layers) on one line."""
    text = json.dumps(plan_to_dict(plan), indent=2)
    one_line = _NUMBER_LIST.sub(lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]", text)
    return one_line + "\n"


def _check_keys(d: object, path: str, allowed: tuple[str, ...], source: str | None) -> Mapping:
    if not isinstance(d, Mapping):
        raise PlanError(
            file=source, field=path or "(top level)", value=d,
            problem="expected a JSON object", fix="write this entry as {...} with keys " + ", ".join(allowed),
        )
    for key in d:
        if key not in allowed:
            where = f"{path}.{key}" if path else str(key)
            raise PlanError(
                file=source, field=where, value=d[key], problem=f"unknown key {key!r}",
                fix="remove it or correct its spelling; allowed keys: " + ", ".join(allowed),
            )
    return d


def _required(d: Mapping, key: str, path: str, source: str | None) -> object:
    if key not in d:
        where = f"{path}.{key}" if path else key
        raise PlanError(
            file=source, field=where, value=None, problem="required key is missing",
            fix=f"add {key!r}",
        )
    return d[key]


def _int(value: object, field: str, source: str | None) -> int:
    # bool is an int subclass in Python; reject it so `true` never becomes 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(file=source, field=field, value=value, problem="expected an integer",
                        fix="write a whole number")
    return value


def _bool(value: object, field: str, source: str | None) -> bool:
    if not isinstance(value, bool):
        raise PlanError(file=source, field=field, value=value, problem="expected true or false",
                        fix="write true or false")
    return value


def _str(value: object, field: str, source: str | None) -> str:
    if not isinstance(value, str):
        raise PlanError(file=source, field=field, value=value, problem="expected a string",
                        fix="write a quoted string")
    return value


def _int_list(value: object, field: str, source: str | None) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise PlanError(file=source, field=field, value=value, problem="expected a list of integers",
                        fix="write a list such as [0, 1]")
    return tuple(_int(v, f"{field}[{i}]", source) for i, v in enumerate(value))


def _stage_from_dict(d: object, path: str, source: str | None) -> StagePlan:
    d = _check_keys(d, path, _STAGE_KEYS, source)
    layers = _int_list(_required(d, "layers", path, source), f"{path}.layers", source)
    if len(layers) != 2:
        raise PlanError(
            file=source, field=f"{path}.layers", value=list(layers),
            problem=f"expected 2 numbers [first, stop), found {len(layers)}",
            fix="write the layer range as [first, stop), e.g. [0, 4]",
        )
    return StagePlan(
        island=_str(_required(d, "island", path, source), f"{path}.island", source),
        device_type=_str(_required(d, "device_type", path, source), f"{path}.device_type", source),
        ranks=_int_list(_required(d, "ranks", path, source), f"{path}.ranks", source),
        layers=(layers[0], layers[1]),
        recompute=_bool(d.get("recompute", False), f"{path}.recompute", source),
        tp_comm_overlap=_bool(d.get("tp_comm_overlap", False), f"{path}.tp_comm_overlap", source),
    )


def _replica_from_dict(d: object, path: str, source: str | None) -> ReplicaPlan:
    d = _check_keys(d, path, _REPLICA_KEYS, source)
    stages = _required(d, "stages", path, source)
    if not isinstance(stages, list | tuple) or not stages:
        raise PlanError(file=source, field=f"{path}.stages", value=stages,
                        problem="expected a non-empty list of stages",
                        fix="list at least one stage object")
    return ReplicaPlan(
        stages=tuple(_stage_from_dict(s, f"{path}.stages[{i}]", source) for i, s in enumerate(stages)),
        num_micro_batches=_int(
            _required(d, "num_micro_batches", path, source), f"{path}.num_micro_batches", source
        ),
    )


def plan_from_dict(d: Mapping[str, object], *, source: str | None = None) -> Plan:
    """Parse a plan dict; raises PlanError naming the key path for any shape or type problem."""
    d = _check_keys(d, "", _PLAN_KEYS, source)
    fmt = _required(d, "format", "", source)
    if fmt != PLAN_FORMAT:
        raise PlanError(file=source, field="format", value=fmt, problem="not a megatron-het plan",
                        fix=f'set "format": "{PLAN_FORMAT}"')
    version = _int(_required(d, "version", "", source), "version", source)
    if version != PLAN_FORMAT_VERSION:
        raise PlanError(
            file=source, field="version", value=version,
            problem=f"unsupported plan format version {version} (this megatron-het reads version "
            f"{PLAN_FORMAT_VERSION})",
            fix="regenerate the plan with this megatron-het version, or set "
            f'"version": {PLAN_FORMAT_VERSION} if it follows docs/plan-format.md',
        )
    replicas = _required(d, "replicas", "", source)
    if not isinstance(replicas, list | tuple) or not replicas:
        raise PlanError(file=source, field="replicas", value=replicas,
                        problem="expected a non-empty list of replicas",
                        fix="list at least one replica object")
    predicted = d.get("predicted")
    if predicted is not None and not isinstance(predicted, Mapping):
        raise PlanError(file=source, field="predicted", value=predicted,
                        problem="expected a JSON object or null", fix="write {...} or null")
    return Plan(
        replicas=tuple(_replica_from_dict(r, f"replicas[{i}]", source) for i, r in enumerate(replicas)),
        micro_batch_size=_int(_required(d, "micro_batch_size", "", source), "micro_batch_size", source),
        global_batch_size=_int(_required(d, "global_batch_size", "", source), "global_batch_size", source),
        schedule=_str(d.get("schedule", "1f1b"), "schedule", source),
        virtual_pipeline_size=_int(d.get("virtual_pipeline_size", 1), "virtual_pipeline_size", source),
        sequence_parallel=_bool(d.get("sequence_parallel", False), "sequence_parallel", source),
        use_distributed_optimizer=_bool(
            d.get("use_distributed_optimizer", False), "use_distributed_optimizer", source
        ),
        predicted=dict(predicted) if predicted is not None else None,
        version=version,
    )


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Atomic write (utils.atomic)."""
    write_text_atomic(path, plan_to_json(plan))


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read and parse a plan JSON file."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise PlanError(file=source, field="(file)", value=source, problem=f"cannot read: {e.strerror}",
                        fix="check the path") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(file=source, field=f"line {e.lineno} column {e.colno}", value=e.msg,
                        problem="invalid JSON", fix="correct the JSON syntax") from e
    return plan_from_dict(data, source=source)
