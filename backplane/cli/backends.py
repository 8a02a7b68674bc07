"""``backplane backends``: the backend matrix (family, name, plugin, availability)."""

from __future__ import annotations

import argparse
import json
import sys

from backplane.cli._command import add_command
from backplane.cli._table import render_table
from backplane.core.hookspecs import FAMILIES
from backplane.core.registry import get_registry


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``backends`` sub-command."""
    parser = add_command(
        subparsers,
        "backends",
        help="list the installed backends of every op family",
        description=(
            "List the backends that the installed plugins provide, best priority first "
            "within each family, with whether each can run here and why not."
        ),
        run=run,
        json_help="print a JSON list of objects (family, name, plugin, available, reason, "
        "priority, capabilities, description, load)",
    )
    parser.add_argument("--family", choices=FAMILIES, help="list only this op family")


def run(args: argparse.Namespace) -> int:
    """Print the backend matrix; return 0."""
    registry = get_registry()
    rows = registry.matrix(args.family)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        table = [
            [
                r["family"],
                r["name"],
                r["plugin"] or "",
                "yes" if r["available"] else "no",
                str(r["priority"]),
                r["description"] if r["available"] else r["reason"],
            ]
            for r in rows
        ]
        headers = ["FAMILY", "NAME", "PLUGIN", "AVAILABLE", "PRIORITY", "DESCRIPTION / REASON"]
        print(render_table(headers, table) if table else "no backends are installed")
    failed = registry.failed_plugins()
    if failed:
        # stderr, so that --json output stays parseable.
        print(
            f"note: {len(failed)} plugin(s) failed to load: {', '.join(sorted(failed))} "
            "(see `backplane plugins`)",
            file=sys.stderr,
        )
    return 0
