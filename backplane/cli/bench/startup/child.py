"""The measured process of ``backplane bench startup``: import, build one engine, report.

``python -m backplane.cli.bench.startup.child SPEC`` is started by
:func:`backplane.cli.bench.startup.run.measure_startup` with ``SPEC`` a JSON
object: ``model`` (what to load), ``overrides`` (the engine's settings),
``spawned`` (``time.monotonic()`` of the parent just before it started this
process: the clock is the machine's, the same in both) and ``log_level``. It
imports backplane's api and with it torch (what any process serving a model pays),
builds an ``LLM``, shuts it down and prints one line, :data:`RESULT_MARKER`
followed by the JSON of :func:`startup_result`, on stdout.
"""

from __future__ import annotations

import time

# first, so that the import phase starts before anything else is imported
_ENTERED = time.monotonic()

import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from typing import Any  # noqa: E402

__all__ = ["CACHE_VARIABLES", "RESULT_MARKER", "main", "startup_result"]

#: the prefix of the stdout line that carries the result
RESULT_MARKER = "backplane-bench-startup-result: "

#: the variables that place the compile caches (set by the engine or, cold, by the parent)
CACHE_VARIABLES = (
    "BACKPLANE_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "FLASHINFER_WORKSPACE_BASE",
    "CUDA_CACHE_PATH",
)


def startup_result(
    *,
    spawned: float,
    imported: float,
    started: float,
    ready: float,
    engine: Mapping[str, Any],
) -> dict[str, Any]:
    """The phases of one start-up: import, the engine's own, and what none of them covers.

    The total is the process's time to a ready engine, less the benchmark's own
    work between the import and the engine's construction.

    :param spawned: monotonic seconds when the parent started the process.
    :param imported: when torch and the api were imported.
    :param started: when the engine's construction began.
    :param ready: when it returned.
    :param engine: the engine's ``startup_timings.as_dict()``.
    :return: ``{"phases": {name: s}, "details": {name: s}, "total": s}``; the
        phases start with ``import`` and end with ``other`` (the total less
        every other phase, never below zero).
    """
    total = (imported - spawned) + (ready - started)
    phases = {"import": imported - spawned}
    for name, seconds in engine.get("phases", {}).items():
        if name != "other":
            phases[name] = float(seconds)
    phases["other"] = max(0.0, total - sum(phases.values()))
    return {"phases": phases, "details": dict(engine.get("details", {})), "total": total}


def main(argv: Sequence[str] | None = None) -> int:
    """Build the engine ``SPEC`` describes and print the start-up's phases.

    :param argv: ``[SPEC]`` (``sys.argv[1:]`` if ``None``).
    :return: the exit code (0).
    """
    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    logging.basicConfig(
        level=getattr(logging, str(spec.get("log_level", "warning")).upper()),
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # backplane first, as a serving process does: it sets torch's OpenMP policy before torch loads
    from backplane.api import LLM

    imported = time.monotonic()
    # the benchmark's own helpers are not part of a serving process's start-up
    from backplane.cli.bench.latency.engines import quiet_missing_tokenizer

    with quiet_missing_tokenizer():
        started = time.monotonic()
        llm = LLM(spec["model"], **spec["overrides"])
        ready = time.monotonic()
    result = startup_result(
        spawned=float(spec.get("spawned", _ENTERED)),
        imported=imported,
        started=started,
        ready=ready,
        engine=llm.engine.startup_timings.as_dict(),
    )
    result["backends"] = {
        f: getattr(b, "name", type(b).__name__) for f, b in llm.engine.backends.items()
    }
    result["graph_mode"] = str(llm.engine.executor.driver.graph_mode.value)
    # which compile caches this process used: the cold run's must be its own empty ones
    result["cache_dirs"] = {var: os.environ.get(var) for var in CACHE_VARIABLES}
    llm.shutdown()
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
