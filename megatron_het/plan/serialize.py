"""Plans of either kind <-> JSON files: the one loader (``load_any_plan``) and the one writer.

The plan types parse and render their own dicts; this module picks the kind from a file's
``"format"`` key and owns the file-level entry points. Nothing here is imported back by the types.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from megatron_het.plan.errors import PlanError
from megatron_het.plan.interface import AnyPlan
from megatron_het.plan.jsonio import read_json
from megatron_het.plan.sharded import SHARDED_PLAN_FORMAT, ShardedPlan
from megatron_het.plan.types import PLAN_FORMAT, Plan

__all__ = ["any_plan_from_dict", "load_any_plan", "plan_to_json", "save_plan"]

_KINDS = {PLAN_FORMAT: Plan, SHARDED_PLAN_FORMAT: ShardedPlan}


def any_plan_from_dict(d: object, *, source: str | None = None) -> Plan | ShardedPlan:
    """A plan of the kind its ``"format"`` key names; PlanError (a UserError) for any problem."""
    fmt = d.get("format") if isinstance(d, Mapping) else None
    kind = _KINDS.get(fmt) if isinstance(fmt, str) else None
    if kind is None:
        raise PlanError(file=source, field="format", value=fmt,
                        problem=f"unknown plan format (this build reads {PLAN_FORMAT!r} and {SHARDED_PLAN_FORMAT!r})",
                        fix="pass a file written by tools/plan.py")
    return kind.from_dict(d, source=source)


def load_any_plan(path: str | os.PathLike[str]) -> Plan | ShardedPlan:
    """A pipeline Plan or a ShardedPlan, chosen by the file's ``"format"`` key; errors name the file."""
    return any_plan_from_dict(read_json(path), source=str(path))


def save_plan(plan: AnyPlan, path: str | os.PathLike[str]) -> None:
    """Atomic write of a plan of either kind (utils/atomic.py)."""
    plan.save(path)


def plan_to_json(plan: AnyPlan) -> str:
    """Indented JSON text with a trailing newline; integer lists (ranks, layers) on one line."""
    return plan.to_json()
