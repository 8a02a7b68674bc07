"""The options the ``backplane bench`` commands share, parsed one way for all of them.

* :func:`int_list`: an argparse type for comma-separated integers (``1,8``),
  optionally with ``none`` for the empty list;
* :func:`csv_list` and :func:`csv_or_none`: comma-separated names;
* :func:`family_backend`: an argparse type for ``FAMILY=NAME`` backend pairs;
* :func:`add_json_output` and :func:`add_json_print`: the two forms of
  ``--json`` (write the result to a file, or print it instead of tables).

The machine a benchmark ran on is described by
:func:`backplane.cli.bench.machine.machine_info`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = [
    "add_json_output",
    "add_json_print",
    "csv_list",
    "csv_or_none",
    "family_backend",
    "int_list",
]


def csv_list(value: str) -> list[str]:
    """Parse ``a, b,,c`` as ``["a", "b", "c"]``.

    :param value: the flag's text.
    :return: the non-empty items, stripped.
    """
    return [v.strip() for v in value.split(",") if v.strip()]


def csv_or_none(value: str) -> list[str]:
    """Parse a comma-separated list where ``none`` is the empty one.

    :param value: the flag's text.
    :return: the items (``[]`` for ``none``).
    """
    return [] if value.strip().lower() == "none" else csv_list(value)


def int_list(example: str, *, allow_none: bool = False) -> Callable[[str], list[int]]:
    """An argparse type for comma-separated integers such as ``64,128``.

    :param example: a valid value, quoted in the usage error.
    :param allow_none: accept ``none`` as the empty list.
    :return: the parser; a value that is not integers is an
        :class:`argparse.ArgumentTypeError` (a usage error naming the flag).
    """
    hint = f"such as {example}" + (" (or none)" if allow_none else "")

    def parse(value: str) -> list[int]:
        if allow_none and value.strip().lower() == "none":
            return []
        try:
            return [int(v) for v in csv_list(value)]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers {hint}, got {value!r}"
            ) from None

    return parse


def family_backend(value: str) -> tuple[str, str]:
    """Parse ``ssm=triton`` as ``("ssm", "triton")``.

    :param value: the flag's text.
    :return: the op family and the backend name.
    :raises argparse.ArgumentTypeError: without a family, an ``=`` or a name.
    """
    family, sep, name = value.partition("=")
    if not sep or not family.strip() or not name.strip():
        raise argparse.ArgumentTypeError(f"expected FAMILY=NAME such as ssm=triton, got {value!r}")
    return family.strip(), name.strip()


def add_json_output(
    parser: argparse.ArgumentParser, help: str = "write every figure and the machine here"
) -> None:
    """Add ``--json PATH``: write the whole result to a file as well as printing the report.

    :param parser: the benchmark's parser.
    :param help: the flag's help text.
    """
    parser.add_argument("--json", metavar="PATH", help=help)


def add_json_print(parser: argparse.ArgumentParser, help: str = "print JSON") -> None:
    """Add ``--json``: print the result as JSON instead of tables.

    :param parser: the benchmark's parser.
    :param help: the flag's help text.
    """
    parser.add_argument("--json", action="store_true", help=help)
