"""The model a job will train, read from the tool's --model and the training flags after ``--``.

tools/slurm.py checks the plan against this model before it writes a job, as pretrain_gpt.py will
at start-up: the model file (``--model`` or ``--hetero-model``) with the Megatron-LM model flags
(``--num-layers``...) on top, the same precedence as pretrain_gpt.py. The flags are derived from
ModelSpec's field names, not declared again.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from megatron_het.cluster import ModelSpec, load_model, model_from_dict
from megatron_het.launch.errors import LaunchError

__all__ = ["check_job_flags", "model_for_job"]

_FIELDS = {f"--{f.name.replace('_', '-')}": f for f in dataclasses.fields(ModelSpec) if f.name != "name"}
_SWITCHES = {flag for flag, f in _FIELDS.items() if f.type in ("bool", bool)}


def _flag_values(args: Sequence[str], flags: set[str]) -> dict[str, str | None]:
    """flag -> its value (None for a switch) for the ``flags`` found in ``args`` (``--f v`` or ``--f=v``)."""
    found: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        if flag in flags:
            if flag in _SWITCHES:
                found[flag] = None
            elif eq:
                found[flag] = value
            elif i + 1 < len(args):
                found[flag] = args[i + 1]
                i += 1
            else:
                raise LaunchError(field=flag, value=None, problem="the flag after -- has no value",
                                  fix=f"write {flag} VALUE")
        i += 1
    return found


def model_for_job(training_args: Sequence[str], *, model_file: str | None = None) -> ModelSpec | None:
    """The ModelSpec the job trains, or None when neither a model file nor model flags are given."""
    found = _flag_values(training_args, {*_FIELDS, "--hetero-model"})
    path = model_file or found.pop("--hetero-model", None)
    found.pop("--hetero-model", None)
    if path is None and not found:
        return None
    base = {k: v for k, v in dataclasses.asdict(load_model(path)).items() if v is not None} if path else {}
    for flag, value in found.items():
        name = _FIELDS[flag].name
        if flag in _SWITCHES:
            base[name] = True
            continue
        try:
            base[name] = int(value)
        except ValueError:
            raise LaunchError(field=flag, value=value, problem="expected an integer",
                              fix=f"write {flag} N after --") from None
    return model_from_dict(base, source=path or "the training flags after --")


def check_job_flags(training_args: Sequence[str], plan: object, *, model_file: str | None = None) -> None:
    """Refuse training flags after ``--`` that pretrain_gpt.py would refuse only after the job waited in
    the queue: batch sizes other than the plan's, and a --hetero-model other than the --model the plan
    was checked against."""
    found = _flag_values(training_args, {"--micro-batch-size", "--global-batch-size", "--hetero-model"})
    # a pipeline plan fixes both sizes; a sharded plan (per-rank micro-batches) fixes the global one
    wanted = {"--global-batch-size": getattr(plan, "global_batch_size", None),
              "--micro-batch-size": getattr(plan, "micro_batch_size", None)}
    for flag, want in wanted.items():
        if want is None or flag not in found:
            continue
        value = found[flag]
        try:
            same = int(value) == want
        except (TypeError, ValueError):
            raise LaunchError(field=flag, value=value, problem="expected an integer",
                              fix=f"write {flag} {want} after --") from None
        if not same:
            raise LaunchError(field=flag, value=value,
                              problem=f"differs from the plan's {flag[2:].replace('-', '_')} {want} "
                                      "(pretrain_gpt.py refuses it after rendezvous)",
                              fix=f"pass {flag} {want} after --, or re-plan for {value}")
    other = found.get("--hetero-model")
    if model_file and other and os.path.realpath(other) != os.path.realpath(model_file) \
            and _shape(load_model(other)) != _shape(load_model(model_file)):
        raise LaunchError(field="--hetero-model", value=other,
                          problem=f"differs from --model {model_file} (the plan is checked against --model "
                                  "but the job would train --hetero-model)",
                          fix=f"pass the same file to both (--hetero-model {model_file} after --), or drop --model")


def _shape(model: ModelSpec) -> dict[str, object]:
    return {k: v for k, v in dataclasses.asdict(model).items() if k != "name"}
