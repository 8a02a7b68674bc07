"""``backplane plugins``: the discovered plugins, where they come from and their errors."""

from __future__ import annotations

import argparse
import json

from backplane.cli._command import add_command
from backplane.cli._table import render_table
from backplane.core.registry import get_registry


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plugins`` sub-command."""
    add_command(
        subparsers,
        "plugins",
        help="list the discovered plugins and their load errors",
        description=(
            "List the plugins found through the 'backplane.plugins' entry points (and the "
            "built-in ones), with their distribution, version, the hooks they implement, "
            "and the error of any plugin that failed to load."
        ),
        run=run,
        json_help="print a JSON list of objects (name, module, distribution, version, hooks, "
        "error, disabled)",
    )


def run(args: argparse.Namespace) -> int:
    """Print the plugin list; return 0 (a failed plugin is reported, not fatal)."""
    registry = get_registry()
    infos = sorted(registry.plugins.values(), key=lambda i: i.name)
    if args.json:
        print(json.dumps([i.as_dict() for i in infos], indent=2))
        return 0
    rows = []
    for info in infos:
        if info.disabled:
            status = "disabled"
        elif info.error:
            status = f"ERROR {info.error}"
        else:
            status = "ok"
        hooks = ",".join(h.removeprefix("backplane_").removesuffix("_backends") for h in info.hooks)
        rows.append(
            [info.name, info.distribution or "-", info.version or "-", hooks or "-", status]
        )
    headers = ["NAME", "DISTRIBUTION", "VERSION", "HOOKS", "STATUS"]
    print(render_table(headers, rows) if rows else "no plugins are installed")
    return 0
