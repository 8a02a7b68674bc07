"""``backplane bench``: the benchmarks of the engine, one sub-command each.

* ``cpu`` (:mod:`.cpu`): the host side's CPU time per decode step, without a model;
* ``latency`` (:mod:`.latency`): decode latency against the memory floor and transformers;
* ``serve`` (:mod:`.serve`): a running server under load over HTTP;
* ``startup`` (:mod:`.startup`): engine start-up time per phase, warm and cold caches;
* ``throughput`` (:mod:`.throughput`): offline serving throughput in one process.

Each benchmark module exposes ``add_arguments(parser)`` and ``run_cli(args)``;
the options they share (integer lists, ``FAMILY=NAME`` pairs, ``--json``) are in
:mod:`.options`, the request workloads of the serving benchmarks in
:mod:`.workload` and the description of the machine in :mod:`.machine`.
"""

from __future__ import annotations

import argparse
import importlib

#: ``(name, one-line help)`` of each benchmark, in the order ``--help`` lists them.
BENCHMARKS: tuple[tuple[str, str], ...] = (
    ("cpu", "CPU time per decode step (schedule + prepare inputs) and Request construction"),
    ("latency", "ms per decode token vs the memory floor and transformers, per batch size"),
    (
        "serve",
        "TTFT / ITL / end-to-end latency and throughput of a running server per request rate",
    ),
    (
        "startup",
        "engine start-up seconds per phase (import, weights, profiling, graph capture, "
        "warm-up), warm and with --cold empty kernel caches",
    ),
    (
        "throughput",
        "offline serving throughput in one process: requests at a rate through AsyncLLM, "
        "transformers on the same batch, decode-only tok/s against the floor",
    ),
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` sub-command and one sub-command per benchmark.

    Each benchmark module is imported here, when the parser is built; its
    module docstring is its ``--help`` description.

    :param subparsers: the top-level parser's sub-parsers.
    """
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks (cpu: scheduling + input preparation; latency: decode; serve: a "
        "server; startup: engine start-up; throughput: offline serving in one process)",
        description="Benchmarks of the engine: its host side (cpu), decode latency (latency), "
        "a running server under load (serve), engine start-up (startup) and offline serving "
        "throughput (throughput).",
    )
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK")
    for name, help in BENCHMARKS:
        module = importlib.import_module(f"{__name__}.{name}")
        bench = sub.add_parser(
            name,
            help=help,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(bench)
        bench.set_defaults(func=module.run_cli)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])
