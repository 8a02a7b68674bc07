"""Registering a sub-command: one parser, its help, and the function that runs it."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    *,
    help: str,
    description: str,
    run: Callable[[argparse.Namespace], int],
    json_help: str | None = None,
) -> argparse.ArgumentParser:
    """Add sub-command ``name`` whose parsed arguments are handed to ``run``.

    :param subparsers: the top-level parser's sub-parsers.
    :param name: the sub-command's name.
    :param help: the one line shown in ``backplane --help``.
    :param description: the paragraph shown in ``backplane NAME --help``.
    :param run: called with the parsed arguments; returns the exit status.
    :param json_help: when given, the command takes ``--json`` (machine-readable
        output) with this help text.
    :return: the sub-command's parser, for its own arguments.
    """
    parser = subparsers.add_parser(name, help=help, description=description)
    if json_help is not None:
        parser.add_argument("--json", action="store_true", help=json_help)
    parser.set_defaults(func=run)
    return parser
