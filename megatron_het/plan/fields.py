"""Typed reads of plan JSON values; each error names the key path, the value and the fix.

Both plan kinds parse their dicts with these (``Plan.from_dict``, ``ShardedPlan.from_dict``), so a
wrong type reads the same whichever kind of plan it is in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from megatron_het.plan.errors import PlanError

__all__ = ["as_bool", "as_fraction", "as_int", "as_int_list", "as_list", "as_str", "check_keys", "required"]


def check_keys(d: object, path: str, allowed: tuple[str, ...], source: str | None) -> Mapping:
    """``d`` as a mapping whose keys are all in ``allowed``."""
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


def required(d: Mapping, key: str, path: str, source: str | None) -> object:
    if key not in d:
        where = f"{path}.{key}" if path else key
        raise PlanError(file=source, field=where, value=None, problem="required key is missing", fix=f"add {key!r}")
    return d[key]


def as_int(value: object, field: str, source: str | None) -> int:
    # bool is an int subclass in Python; reject it so `true` never becomes 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(file=source, field=field, value=value, problem="expected an integer",
                        fix="write a whole number")
    return value


def as_bool(value: object, field: str, source: str | None) -> bool:
    if not isinstance(value, bool):
        raise PlanError(file=source, field=field, value=value, problem="expected true or false",
                        fix="write true or false")
    return value


def as_str(value: object, field: str, source: str | None) -> str:
    if not isinstance(value, str):
        raise PlanError(file=source, field=field, value=value, problem="expected a string",
                        fix="write a quoted string")
    return value


def as_fraction(value: object, field: str, source: str | None) -> float:
    """A finite number in [0, 1] (an int 0 or 1 is accepted)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not 0.0 <= value <= 1.0:
        raise PlanError(file=source, field=field, value=value, problem="expected a number in [0, 1]",
                        fix="write the share as a fraction, e.g. 0.25")
    return float(value)


def as_list(value: object, field: str, source: str | None, *, what: str) -> list | tuple:
    """A non-empty JSON list of ``what``."""
    if not isinstance(value, list | tuple) or not value:
        raise PlanError(file=source, field=field, value=value, problem=f"expected a non-empty list of {what}",
                        fix=f"list at least one {what.rstrip('s')} object")
    return value


def as_int_list(value: object, field: str, source: str | None) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise PlanError(file=source, field=field, value=value, problem="expected a list of integers",
                        fix="write a list such as [0, 1]")
    return tuple(as_int(v, f"{field}[{i}]", source) for i, v in enumerate(value))
