"""``backplane bench startup``: where an engine's start-up time goes, phase by phase.

For each model shape, one engine is started in a fresh process (so the import
is paid as a serving process pays it) and the seconds of each start-up phase
are reported beside the total:

* **import**: the interpreter, torch and backplane's api;
* **backend selection**: plugin discovery and the choice of a backend per op family;
* **weight load**: building the model and reading its weights (and, on the
  CPU, packing them for oneDNN);
* **memory profiling**: the largest step run once to size the KV cache (CUDA);
  on a cold cache this is where the first kernels compile;
* **cache allocation**: the KV and recurrent-state caches;
* **graph capture**: tracing and compiling the piecewise graphs, capturing
  every bucket's graphs;
* **kernel warm-up**: the scratch steps that compile the kernel variants the
  captures did not reach;
* **engine setup**: the scheduler, KV-cache manager, speculative proposer;
* **other**: what none of these covers (configuration, worker construction).

The engine measures the phases itself (``Engine.startup_timings``, logged at
INFO as one line at the end of start-up); the report also breaks graph
capture down by kind (the first bucket of each, which pays for tracing and
compiling, apart from the rest) and the warm-up by step kind.

The **warm** run uses the kernel caches as they are (filled by earlier runs,
or by ``backplane warmup``); ``--cold`` measures a second start-up with every
on-disk compile cache (Triton, Inductor, FlashInfer's JIT, the CUDA driver's)
in a new empty directory, set in that process's environment only, so this
machine's caches stay as they were.

Shapes are those of ``bench latency`` (``llama-3.2-1b``, ``llama-3.1-8b``,
``qwen3-8b``, ``nemotron-h-8b`` ...), a preset such as ``tiny-llama`` (for the
CPU), a model directory or a GGUF file; a named shape is saved once with
random weights (kept with ``--weights-dir``).

Examples::

    backplane bench startup --shapes tiny-llama --device cpu
    backplane bench startup --shapes llama-3.1-8b,nemotron-h-8b --cold \\
        --weights-dir /tmp/bench-weights --json startup.json
    backplane bench startup --shapes nemotron-h-8b --attention triton --cuda-graphs off
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING

from backplane.cli.bench.options import add_json_output, csv_list, family_backend
from backplane.core.errors import ConfigError

if TYPE_CHECKING:
    from backplane.cli.bench.startup.run import StartupSettings

__all__ = ["add_arguments", "run_cli", "settings_from_args"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``backplane bench startup`` to ``parser``.

    :param parser: the sub-command's parser.
    """
    parser.add_argument(
        "--shapes",
        type=csv_list,
        default=["llama-3.2-1b"],
        metavar="NAME,...",
        help="model shapes as for bench latency (llama-3.2-1b, llama-3.1-8b, qwen3-8b, "
        "nemotron-h-8b ...), a preset such as tiny-llama, a model directory or a .gguf file "
        "(default: llama-3.2-1b)",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )
    parser.add_argument(
        "--attention", default="auto", metavar="NAME", help="the attention backend (auto)"
    )
    parser.add_argument(
        "--backend",
        type=family_backend,
        action="append",
        default=[],
        metavar="FAMILY=NAME",
        help="the backend of another op family, e.g. ssm=triton (default: auto)",
    )
    parser.add_argument(
        "--cuda-graphs",
        choices=("on", "off"),
        default="on",
        help="on: the engine's default graph mode (captures); off: eager (default: on)",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="also start once with empty Triton / Inductor / FlashInfer / CUDA caches "
        "(a temporary directory; this machine's caches are left alone)",
    )
    parser.add_argument("--max-model-len", type=int, metavar="N", help="(default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, metavar="N", help="(default: the engine's)")
    parser.add_argument("--max-num-tokens", type=int, metavar="N", help="(default: the engine's)")
    parser.add_argument(
        "--weights-dir",
        metavar="DIR",
        help="keep the saved random-weight folders here, to reuse them "
        "(default: a temporary folder)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        metavar="S",
        help="seconds one start-up may take before it counts as failed (default: 1800)",
    )
    add_json_output(parser, help="write the phases of every run and the machine here")


def settings_from_args(args: argparse.Namespace) -> StartupSettings:
    """Build :class:`StartupSettings` from parsed ``bench startup`` flags.

    :param args: what :func:`add_arguments`' flags parsed to.
    :return: the run's settings.
    :raises ConfigError: a limit that is not positive.
    """
    # imported here: the measured process imports this package first, and should pay no more
    from backplane.cli.bench.startup.run import StartupSettings

    for flag in ("max_model_len", "max_num_seqs", "max_num_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {value}: give a positive integer")
    if not args.shapes:
        raise ConfigError("--shapes: give at least one shape, e.g. --shapes tiny-llama")
    return StartupSettings(
        shapes=list(args.shapes),
        device=args.device,
        dtype=args.dtype,
        attention=args.attention,
        cuda_graphs=args.cuda_graphs,
        backends=dict(args.backend),
        cold=args.cold,
        weights_dir=args.weights_dir,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_tokens=args.max_num_tokens,
        timeout=args.timeout,
        log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
    )


def run_cli(args: argparse.Namespace) -> int:
    """Run ``backplane bench startup``: print the report, write ``--json``.

    :param args: the parsed flags.
    :return: 0, or 1 when some start-up failed (its error is in the report).
    :raises BackplaneError: a user error (bad settings, an unknown shape).
    """
    from backplane.cli.bench.startup.report import format_report
    from backplane.cli.bench.startup.run import run_startup_benchmark

    result = run_startup_benchmark(settings_from_args(args))
    sys.stdout.write(format_report(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        logger.info("wrote %s", args.json)
    failed = any(r.get("status") != "ok" for s in result["shapes"] for r in s["runs"].values())
    return 1 if failed else 0
