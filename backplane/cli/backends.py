"""``backplane backends``: the backend matrix (family, name, plugin, availability, speed)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any

from backplane.cli._command import add_command
from backplane.cli._table import render_table
from backplane.core.hookspecs import FAMILIES
from backplane.core.registry import get_registry
from backplane.engine.selection import device_class_of


def _this_device_class() -> str:
    """The class of the device ``auto`` would run on here: the first CUDA device, else the CPU."""
    if importlib.util.find_spec("torch") is None:
        return "cpu"
    import torch

    return device_class_of("cuda" if torch.cuda.is_available() else "cpu") or "cpu"


def _speed_cell(row: dict[str, Any], device_class: str) -> str:
    """The measured figures of one row on ``device_class``, as the table shows them."""
    figures = row["speed"].get(device_class)
    if not figures:
        return "-"
    shown = [
        f"{kind} {figures[kind]:.0f}" for kind in ("decode", "prefill") if figures[kind] is not None
    ]
    return ", ".join(shown) or "-"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``backends`` sub-command."""
    parser = add_command(
        subparsers,
        "backends",
        help="list the installed backends of every op family",
        description=(
            "List the backends that the installed plugins provide, best priority first "
            "within each family, with whether each can run here and why not, and the "
            "speed they measured on this device class (tokens/s), which auto ranks by "
            "before priority."
        ),
        run=run,
        json_help="print a JSON list of objects (family, name, plugin, available, reason, "
        "priority, capabilities, description, load, speed)",
    )
    parser.add_argument("--family", choices=FAMILIES, help="list only this op family")
    parser.add_argument(
        "--device-class",
        metavar="CLASS",
        help="show the measured speed for this device class (sm90, sm80, cpu; "
        "default: this machine's first CUDA device, else cpu)",
    )


def run(args: argparse.Namespace) -> int:
    """Print the backend matrix; return 0."""
    registry = get_registry()
    rows = registry.matrix(args.family)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        device_class = args.device_class or _this_device_class()
        table = [
            [
                r["family"],
                r["name"],
                r["plugin"] or "",
                "yes" if r["available"] else "no",
                str(r["priority"]),
                _speed_cell(r, device_class),
                r["description"] if r["available"] else r["reason"],
            ]
            for r in rows
        ]
        headers = [
            "FAMILY",
            "NAME",
            "PLUGIN",
            "AVAILABLE",
            "PRIORITY",
            f"TOK/S ON {device_class}",
            "DESCRIPTION / REASON",
        ]
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
