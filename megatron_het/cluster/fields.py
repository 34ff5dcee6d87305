"""Typed reads of YAML values with field paths in the errors.

Every reader takes the parsed value and its path (``islands[1].nodes``) and either returns the
value as the right Python type or raises :class:`ConfigError`. Files are filled in by the loader.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from typing import Any

from megatron_het.cluster.errors import ConfigError, suggest

__all__ = [
    "as_mapping",
    "as_list",
    "as_str",
    "as_name",
    "as_int",
    "as_float",
    "as_bool",
    "check_keys",
    "join",
]


def join(path: str, key: str | int) -> str:
    """Child path: ``join("islands", 1) == "islands[1]"``, ``join("islands[1]", "nodes")``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def as_mapping(value: object, path: str, *, example: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"must be a mapping of keys to values, not {_type_name(value)}",
            field=path,
            value=value,
            fix=f"write it as key: value lines, e.g. {example}",
        )
    return value


def as_list(value: object, path: str, *, example: str) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(
            f"must be a list, not {_type_name(value)}",
            field=path,
            value=value,
            fix=f"write it as a YAML list ('- ' items), e.g. {example}",
        )
    return value


def as_str(value: object, path: str, *, example: str = "'a100-pod'") -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f"must be a non-empty string, not {_type_name(value)}",
            field=path,
            value=value,
            fix=f"write a string such as {example} (quote it if it looks like a number)",
        )
    return value


# Names that end up in job scripts, environment variables and Slurm directives (island, device type,
# network interface): a newline, "$(...)" or a comma there would alter the generated sbatch script.
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
MAX_NAME_LENGTH = 64  # longer names are a mistake, not a cluster


def as_name(value: object, path: str, *, example: str = "'a100-pod'", max_length: int = MAX_NAME_LENGTH,
            fix: str | None = None) -> str:
    """A non-empty name of letters, digits and ``_ . -`` only, at most ``max_length`` characters."""
    name = as_str(value, path, example=example)
    if not _NAME.fullmatch(name) or len(name) > max_length:
        suggestion = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")[:max_length]
        raise ConfigError(
            f"must be 1-{max_length} letters, digits, '_', '.' or '-' (it is written into job scripts)",
            field=path,
            value=value,
            fix=fix or f"rename it, e.g. {repr(suggestion) if suggestion else example}",
        )
    return name


def as_int(value: object, path: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    """An int in [``minimum``, ``maximum``]; rejects bools, floats and numeric strings (say where the quote is)."""
    if isinstance(value, bool) or not isinstance(value, int):
        hint = ""
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            hint = f" (remove the quotes: {value.strip()})"
        elif isinstance(value, float) and value.is_integer():
            hint = f" (write {int(value)} without a decimal point)"
        raise ConfigError(
            f"must be an integer, not {_type_name(value)}",
            field=path,
            value=value,
            fix=f"write a whole number >= {minimum}{hint}",
        )
    if value < minimum:
        raise ConfigError(
            f"must be >= {minimum}",
            field=path,
            value=value,
            fix=f"use an integer of at least {minimum}",
        )
    if maximum is not None and value > maximum:
        raise ConfigError(
            f"must be <= {maximum:,} (larger values are a typo, not a cluster or model)",
            field=path,
            value=value,
            fix=f"use an integer of at most {maximum:,}",
        )
    return value


def as_float(value: object, path: str, *, minimum: float = 0.0, inclusive: bool = False) -> float:
    """A number > ``minimum`` (or >= when ``inclusive``); ints are accepted, strings are not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            f"must be a number, not {_type_name(value)}",
            field=path,
            value=value,
            fix="write a plain number without quotes or units, e.g. 200",
        )
    number = float(value)
    if math.isinf(number):
        raise ConfigError("must be a finite number", field=path, value=value,
                          fix="write the figure itself, e.g. 200")
    too_small = number < minimum if inclusive else number <= minimum
    if too_small or number != number:  # NaN fails every comparison
        op = ">=" if inclusive else ">"
        raise ConfigError(
            f"must be {op} {minimum:g}",
            field=path,
            value=value,
            fix=f"use a number {op} {minimum:g}",
        )
    return number


def as_bool(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(
            f"must be true or false, not {_type_name(value)}",
            field=path,
            value=value,
            fix="write true or false without quotes",
        )
    return value


def check_keys(
    data: Mapping[str, Any],
    path: str,
    *,
    allowed: Collection[str],
    required: Collection[str] = (),
) -> None:
    """Unknown keys get the nearest valid key suggested; missing required keys are named."""
    for key in data:
        if key not in allowed:
            raise ConfigError(
                "unknown key",
                field=join(path, str(key)),
                value=key,
                fix=suggest(str(key), allowed, what="keys here"),
            )
    for key in required:
        if key not in data:
            raise ConfigError(
                "required key is missing",
                field=join(path, key),
                value=None,
                fix=f"add '{key}:' to {path or 'the top level'}",
            )
