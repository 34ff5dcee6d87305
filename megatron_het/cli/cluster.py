"""Inspect cluster and model files.

    python tools/cluster.py show examples/clusters/a100-mi250x.yaml
    python tools/cluster.py model examples/models/llama2-7b.yaml
    python tools/cluster.py catalog [--no-sources]

Errors in a file are printed on stderr in one line (file, field, value, fix) with exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from megatron_het.cli.output import quiet_on_broken_pipe
from megatron_het.cluster import (
    CATALOG,
    format_catalog,
    format_cluster,
    format_model,
    load_cluster,
    load_model,
)
from megatron_het.errors import UserError


@quiet_on_broken_pipe
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cluster.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="validate a cluster YAML file and print it")
    show.add_argument("file")
    model = sub.add_parser("model", help="validate a model YAML file and print it")
    model.add_argument("file")
    catalog = sub.add_parser("catalog", help="list the built-in device types")
    catalog.add_argument("--no-sources", action="store_true", help="omit the datasheet references")
    args = parser.parse_args(argv)
    try:
        if args.command == "show":
            print(format_cluster(load_cluster(args.file)))
        elif args.command == "model":
            print(format_model(load_model(args.file)))
        else:
            print(format_catalog(CATALOG, sources=not args.no_sources))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
