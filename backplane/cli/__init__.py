"""The ``backplane`` command line.

Each sub-command lives in its own module ``backplane.cli.<name>`` exposing
``add_parser(subparsers)``, which adds the sub-command (with its help) and sets
``func`` to a callable taking the parsed arguments and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from backplane import __version__
from backplane.core.errors import BackplaneError

logger = logging.getLogger(__name__)

#: The sub-commands, in the order ``backplane --help`` lists them.
COMMANDS: tuple[str, ...] = ("backends", "plugins", "generate", "bench", "warmup", "serve")

#: Exit code of a command that failed with a :class:`BackplaneError` (a user error).
EXIT_USER_ERROR = 2

LOG_LEVELS = ("debug", "info", "warning", "error")


def _add_broken_command(subparsers: argparse._SubParsersAction, name: str, error: str) -> None:
    """Keep a sub-command whose module fails to import visible, failing only when run."""

    def run(args: argparse.Namespace) -> int:
        raise BackplaneError(f"the {name!r} command cannot run: {error}")

    parser = subparsers.add_parser(name, help=f"(unavailable: {error})")
    parser.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    """Build the ``backplane`` argument parser with every installed sub-command.

    A command module that does not exist is left out; one that fails to import
    is listed and reports its import error when run, so that one broken
    command never takes the others down.
    """
    parser = argparse.ArgumentParser(
        prog="backplane",
        description="LLM inference engine for hybrid models with plugin kernel backends.",
    )
    parser.add_argument("--version", action="version", version=f"backplane {__version__}")
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="warning",
        type=str.lower,
        help="logging verbosity (default: warning)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module_name = f"{__name__}.{name}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # not part of this installation
            _add_broken_command(subparsers, name, f"{type(exc).__name__}: {exc}")
            continue
        except Exception as exc:
            _add_broken_command(subparsers, name, f"{type(exc).__name__}: {exc}")
            continue
        module.add_parser(subparsers)
    # Accept --log-level after the command name too (`backplane generate --log-level info`).
    for sub in subparsers.choices.values():
        try:
            sub.add_argument(
                "--log-level",
                choices=LOG_LEVELS,
                type=str.lower,
                default=argparse.SUPPRESS,
                help="logging verbosity (default: warning)",
            )
        except argparse.ArgumentError:
            pass  # the command defines its own
    return parser


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``backplane`` command line.

    :param argv: the arguments (``sys.argv[1:]`` if ``None``).
    :return: the exit code: ``0`` on success, ``2`` for a usage or user error
        (a :class:`~backplane.core.errors.BackplaneError`, printed as one line
        without a traceback), otherwise what the command returned.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.log_level)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return EXIT_USER_ERROR
    try:
        return int(func(args) or 0)
    except BackplaneError as exc:
        # One line whatever the message holds (a reason quoted from a library may span several).
        message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"backplane: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("backplane: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `backplane backends | head`: the reader went away; not an error.
        sys.stderr.close()
        return 0
