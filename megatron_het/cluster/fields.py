"""Typed reads of YAML values with field paths in the errors.

Every reader takes the parsed value and its path (``islands[1].nodes``) and either returns the
value as the right Python type or raises :class:`ConfigError`. Files are filled in by the loader.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from megatron_het.cluster.errors import ConfigError, suggest

__all__ = [
    "as_mapping",
    "as_list",
    "as_str",
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


def as_int(value: object, path: str, *, minimum: int = 1) -> int:
    """An int >= ``minimum``; rejects bools, floats and numeric strings (say where the quote is)."""
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
