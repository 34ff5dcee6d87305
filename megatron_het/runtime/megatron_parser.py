"""Megatron-LM's own argument parser, with megatron-het's flags added the way a fork adds its own.

The definitions and defaults are ``megatron.training.arguments.add_megatron_arguments`` from the
megatron-core wheel (every Megatron-LM flag, 800+). We do not call Megatron's ``parse_args``: it
reads ``sys.argv`` and the environment and runs Megatron's global set-up; ``pretrain_gpt.py``
parses the argv it is given and builds typed objects from the namespace (``runtime/arguments.py``).
What each Megatron flag does here is ``runtime/flag_policy.py``'s table.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

# Megatron types these int; tests bound hung collectives and time limits in fractions of a minute,
# so the parser accepts floats too (every int Megatron accepts still parses to the same value).
WIDENED_TYPES = {"distributed_timeout_minutes": float, "exit_duration_in_mins": float}


def megatron_parser(*, prog: str, description: str) -> argparse.ArgumentParser:
    """A parser holding every Megatron-LM flag with Megatron's default (``allow_abbrev=False`` as
    Megatron's). The caller adds its own flags to it (Megatron's ``extra_args_provider``)."""
    import warnings

    import megatron_het.platform  # noqa: F401  (import guards: triton, typing.override on 3.11)

    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed" x4 at import
        warnings.simplefilter("ignore")
        from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    add_megatron_arguments(parser)
    for action in parser._actions:
        if action.dest in WIDENED_TYPES:
            action.type = WIDENED_TYPES[action.dest]
    return parser


def megatron_dests(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every flag's destination -> its first action (flags sharing a destination, such as
    ``--disable-bias-linear``/``--add-bias-linear``, share one entry)."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            out.setdefault(action.dest, action)
    return out


def given_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> frozenset[str]:
    """Destinations of the flags written on the command line (also when written with their default
    value): what the user asked for, as opposed to what a default supplied."""
    options = parser._option_string_actions
    given = set()
    for token in argv:
        if token.startswith("--"):
            action = options.get(token.split("=", 1)[0])
            if action is not None:
                given.add(action.dest)
    return frozenset(given)


def option_name(parser: argparse.ArgumentParser, dest: str) -> str:
    """The flag spelling that sets ``dest`` (its first option string)."""
    for action in parser._actions:
        if action.dest == dest and action.option_strings:
            return action.option_strings[0]
    return "--" + dest.replace("_", "-")
