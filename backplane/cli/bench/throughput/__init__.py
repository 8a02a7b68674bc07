"""``backplane bench throughput``: offline serving throughput in one process.

One engine, built from the usual engine flags, measured three ways in one run:

1. **Requests at a rate**: ``--num-prompts`` requests from a seeded synthetic
   mix of prompt and output lengths shaped like ShareGPT conversations
   (:func:`backplane.cli.bench.workload.sharegpt_like_requests`; ``--input-len`` /
   ``--output-len`` force fixed lengths), sent to :class:`~backplane.api.AsyncLLM`
   with Poisson arrivals at each ``--request-rate`` (``inf``: all at once).
   Each request streams its tokens: its time to first token (TTFT), the gaps
   between its tokens (ITL; a streamed output of k tokens counts as k gaps of
   a k-th of its wait) and its end-to-end time are taken from its stream.
   Output lengths are exact (``ignore_eos``). Per rate: requests/s, output and
   total (prompt + output) tokens/s, TTFT / ITL / end-to-end p50 and p99.
   A few untimed requests (``--warmup-prompts``) run first.
2. **transformers** on the same weights, where it can run the same work: all
   requests at once (an ``inf`` rate) with one output length (``--output-len``);
   one ``generate`` call over the whole batch, prompts padded on the left;
   its output tokens/s beside backplane's at ``inf``, and the ratio. Skipped,
   with the reason, otherwise (a mix of output lengths, rates only, a model
   that is not a Hugging Face folder).
3. **Decode-only** throughput at ``--decode-batch-sizes`` (64, 128, 256): a
   batch of sequences with a short prompt decodes ``--decode-steps`` steps
   together; ms per step (after the first token) and tokens/s, against the
   HBM floor of a step (every weight and the KV cache read once at the
   measured read bandwidth, as in ``backplane bench latency``). The floor
   needs a CUDA device and a model whose weights this command saved itself.

``--model`` takes the latency benchmark's shapes (``llama-1b``,
``nemotron-h-0.85b``, ``llama-3.2-1b``, ``llama-3.1-8b``, ``qwen3-8b``,
``nemotron-h-8b``) and the built-in presets (``tiny-llama`` ...), whose
fixed-seed random weights are saved once as a Hugging Face folder that both
backplane and transformers load, as well as ``smollm2``, a model directory
(its floor from its safetensors headers) or a ``.gguf`` file.

Published figures: ``llama-3.1-8b`` with the ShareGPT-like mix, about 1000
requests (900 to 1100), rate ``inf``, bfloat16 on one H100 is set against
other engines' published output tok/s on that workload, with the ratio and
the source (:data:`backplane.cli.bench.anchors.ANCHORS`), in the report and
under ``anchors`` in the JSON. When ``--max-num-seqs`` is not given, the engine takes the
largest decode batch as its sequence limit; prefix caching is off unless
``--prefix-caching`` is given (each rate sends the same prompts again).
``--seed`` seeds the request mix, the arrivals and the engine's sampling.

Examples::

    backplane bench throughput --model llama-1b --input-len 512 --output-len 128 \\
        --num-prompts 32 --backend attention=triton --json t.json --plot t.png
    backplane bench throughput --model llama-1b --num-prompts 1000 --request-rate 4,16,64,inf
    backplane bench throughput --model llama-3.1-8b --num-prompts 1000 --decode-batch-sizes none
    backplane bench throughput --model tiny-llama --device cpu --num-prompts 8 \\
        --input-len 16 --output-len 8 --decode-batch-sizes 4,8   # a CPU check
"""

from __future__ import annotations

import argparse
import json
import logging

from backplane.cli.bench.options import add_json_output, int_list
from backplane.cli.bench.throughput.report import matplotlib_reason, print_report, write_plot
from backplane.cli.bench.throughput.run import run_throughput
from backplane.cli.options import add_engine_arguments

logger = logging.getLogger(__name__)


__all__ = ["add_arguments", "run_cli", "run_throughput"]

DECODE_BATCH_SIZES: tuple[int, ...] = (64, 128, 256)
"""Batch sizes of the decode-only measurement by default."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``backplane bench throughput`` (the engine flags included).

    :param parser: the sub-command's parser.
    """
    parser.add_argument(
        "--num-prompts", type=int, default=200, metavar="N", help="requests per rate (200)"
    )
    parser.add_argument(
        "--request-rate",
        default="inf",
        metavar="R,...",
        help="requests per second, Poisson arrivals; inf = all at once; several rates are "
        "run one after another (default: inf)",
    )
    parser.add_argument(
        "--input-len",
        type=int,
        default=None,
        metavar="N",
        help="every prompt has N tokens (default: the ShareGPT-like mix)",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        default=None,
        metavar="N",
        help="every request produces N tokens (default: the ShareGPT-like mix)",
    )
    parser.add_argument(
        "--max-input-len",
        type=int,
        default=1024,
        metavar="N",
        help="longest prompt of the mix (1024)",
    )
    parser.add_argument(
        "--max-output-len",
        type=int,
        default=1024,
        metavar="N",
        help="longest output of the mix (1024); prompt + output also stays within "
        "min(2048, max_model_len)",
    )
    parser.add_argument(
        "--warmup-prompts",
        type=int,
        default=8,
        metavar="N",
        help="untimed requests (the mix's first N, all at once) before the timed ones (8)",
    )
    parser.add_argument(
        "--decode-batch-sizes",
        type=int_list("64,128,256", allow_none=True),
        default=list(DECODE_BATCH_SIZES),
        metavar="B,...",
        help="decode-only batch sizes, or none (default: 64,128,256)",
    )
    parser.add_argument(
        "--decode-prompt-len",
        type=int,
        default=32,
        metavar="N",
        help="prompt tokens per sequence of the decode-only runs (32)",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=128,
        metavar="N",
        help="tokens each sequence decodes in the decode-only runs (128)",
    )
    parser.add_argument(
        "--transformers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run transformers generate on the same weights and batch where it can (default: on)",
    )
    parser.add_argument(
        "--weights-dir",
        metavar="DIR",
        help="keep the saved random-weight folders here (default: a temporary folder)",
    )
    add_json_output(parser)
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG of output tokens/s against request rate and decode batch (matplotlib)",
    )
    add_engine_arguments(parser)


def run_cli(args: argparse.Namespace) -> int:
    """Run ``backplane bench throughput``: print the report, write ``--json`` / ``--plot``.

    :param args: the parsed flags.
    :return: the exit code (0).
    """
    result = run_throughput(args)
    if args.plot:
        why = matplotlib_reason()
        if why is None:
            write_plot(result, args.plot)
            result["plot"] = {"path": args.plot}
        else:
            result["plot"] = {"skipped": why}
    print_report(result)
    if args.plot:
        plot = result["plot"]
        print(
            f"plot: wrote {plot['path']}"
            if "path" in plot
            else f"plot: skipped ({plot['skipped']})"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        logger.info("wrote %s", args.json)
    return 0
