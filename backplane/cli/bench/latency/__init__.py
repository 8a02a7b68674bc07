"""``backplane bench latency``: decode latency against the memory floor and transformers.

For each model shape and batch size, in one process and one run:

1. **the memory floor**: the device's read bandwidth, measured (a reduction
   over a large tensor timed with CUDA events, best of several), and the bytes
   one decode step must read: every weight once (the embedding only for the
   rows looked up, experts only as many as the batch can route to, the LM head
   in full), the KV cache at the mean context length of the decode steps, and
   the recurrent state of hybrid layers (read and written back); floor
   ``ms = bytes / bandwidth``;
2. **backplane** end to end through ``LLM.generate``, for each attention
   backend (``torch``, ``triton``, ``flashinfer``; an unavailable one is
   skipped with the registry's reason), with CUDA graphs on (the default mode)
   and off; engines are built one after another and freed in between;
3. **transformers** on the same weights: eager with its default dynamic cache,
   and a static cache with the decode step compiled (``torch.compile``,
   ``mode="reduce-overhead"``, through ``generate``'s ``compile_config``).

Both sides decode greedily from the same random prompts and produce the same
number of tokens. The weights are random: each shape is built once with
backplane's fixed-seed initialisation, saved as a Hugging Face folder
(``config.json`` + safetensors) and loaded from there by both sides.

The figure reported is **ms per output token** of one sequence, i.e. per decode
step of the batch: ``(time of the last token - time of the first token) /
(new tokens - 1)``; the time to first token (prompt processing) is reported
apart. The table shows it per configuration and batch size, with its ratio to
the floor and to transformers static + compile.

Shapes: ``llama-1b`` (1.1B Llama: hidden 2048, 16 layers, 32/8 heads of 64,
MLP 8192, vocabulary 32000) and ``nemotron-h-0.85b`` (a 24-layer Nemotron-H
hybrid of the same width: 10 Mamba2 layers of 64 heads x 64 with state 128,
2 attention layers, 12 ReLU^2 MLP layers of 8192), the defaults; the shapes of
published models: ``llama-3.2-1b`` (the 1.1B body with a tied 128k vocabulary:
the LM head is the embedding, read in full each step), ``llama-3.1-8b``,
``qwen3-8b`` and ``nemotron-h-8b`` (52 layers: 24 Mamba2, 4 attention, 24
MLP); ``qwen3-next-1b-mtp`` (12 Qwen3-Next layers, 9 delta-rule and 3
attention, with one MTP layer, for ``--speculative-config`` method ``mtp``);
any built-in preset name (``tiny-llama``, ``tiny-nemotron-h`` ...) runs
that tiny model, for CPU checks; and a model directory (``config.json`` +
safetensors) is measured with its own weights, its floor from the sizes in
its safetensors headers, as is a ``.gguf`` file or an installed model
(``smollm2``: SmolLM2-135M-Instruct), its floor from its GGUF tensor table.

**Quantised weights and KV cache**: ``--quantization fp8`` has each backplane
engine quantise the saved projections to FP8 (e4m3, a float32 scale per
output row) on load; the floor counts what such a step reads (each
projection one byte a weight plus its scales; embedding rows, norms, the LM
head in the run's dtype, as the engine keeps them), and the floor of the same
shape in the run's dtype is kept beside it in the table and the JSON.
``--kv-cache-dtype fp8`` stores the KV cache in e4m3 (one byte an element in
the floor). ``--weights-format gguf-q4_k`` writes a llama-family shape
(``llama-1b``, ``llama-3.2-1b``, ``llama-3.1-8b``, ``qwen3-8b``,
``tiny-llama``) once as a random-weight GGUF file, its projections in Q4_K
(rows that are not whole 256-value blocks, as in the tiny presets, in Q8_0),
the output head in Q6_K, the embedding in F16 and the norms in F32, kept under
``--weights-dir`` as ``<shape>-gguf-q4_k.gguf``; its floor comes from the
file's tensor table, as for a ``.gguf`` input. transformers rows are skipped
with FP8 weights and GGUF files (they would not run the same weights), and
published figures (of bfloat16 runs) are not compared.

**Published figures**: where one exists for the shape, the workload (batch 1
in bfloat16) and the GPU kind (H100, H200, from the device name), the report
prints it beside backplane's best batch-1 configuration, with the ratio and
the source, and the JSON keeps it under each shape's ``anchors``; the table
is :data:`backplane.cli.bench.anchors.ANCHORS`.

**Speculative decoding**: ``--speculative-config JSON`` measures each
backplane configuration again with speculation and reports, beside the run
without it, the effective ms per generated token (the decode phase's wall
time over the tokens generated), its ratio to the same floor, the speedup,
the acceptance rate and the mean accepted length (from the requests' own
metrics). ``--workload rewrite`` asks a trained checkpoint to rewrite an
English paragraph in a chat turn (the prompt length is that prompt's), and
prompts a random-weight shape with a repeated random document; with random
weights the acceptance depends on what the model itself repeats, so read the
speedup beside it (see :mod:`~backplane.cli.bench.latency.speculation`).

Examples::

    backplane bench latency --json latency.json --plot latency.png
    backplane bench latency --shapes llama-1b --batch-sizes 1,4,16 --attention triton
    backplane bench latency --shapes tiny-llama --prompt-len 32 --new-tokens 8   # CPU
    backplane bench latency --shapes llama-3.2-1b --batch-sizes 1 --prompt-len 32
    backplane bench latency --plot-from latency.json --plot latency.png
    backplane bench latency --shapes llama-1b --batch-sizes 1 --workload rewrite \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    backplane bench latency --shapes smollm2 --device cpu --batch-sizes 1 --new-tokens 96 \\
        --transformers none --workload rewrite \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    backplane bench latency --shapes qwen3-next-1b-mtp --batch-sizes 1 --transformers none \\
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'
    backplane bench latency --shapes llama-3.1-8b --batch-sizes 1 --transformers none \\
        --quantization fp8
    backplane bench latency --shapes llama-3.1-8b --batch-sizes 1 --transformers none \\
        --quantization fp8 --kv-cache-dtype fp8
    backplane bench latency --shapes llama-3.1-8b --batch-sizes 1 --transformers none \\
        --weights-format gguf-q4_k --weights-dir /tmp/bench-weights

A default run takes several minutes on one GPU (weight initialisation, CUDA
graph capture per engine, transformers compilation per batch size); one shape
per run keeps each command shorter, and ``--plot-from`` merges their JSON::

    backplane bench latency --shapes llama-1b --json llama.json
    backplane bench latency --shapes nemotron-h-0.85b --json hybrid.json
    backplane bench latency --plot-from llama.json hybrid.json --plot latency.png
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from backplane.cli.bench.latency.floor import floor_bytes, measure_bandwidth
from backplane.cli.bench.latency.report import (
    format_report,
    load_result,
    matplotlib_missing,
    merge_results,
    write_plot,
)
from backplane.cli.bench.latency.run import run_benchmark, run_shape
from backplane.cli.bench.latency.settings import (
    ATTENTION_BACKENDS,
    DEFAULT_SHAPES,
    GRAPH_MODES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    TRANSFORMERS_MODES,
    WEIGHTS_FORMATS,
    Settings,
)
from backplane.cli.bench.latency.shapes import SHAPES, shape_config
from backplane.cli.bench.latency.speculation import WORKLOADS, parse_speculative_config
from backplane.cli.bench.latency.weights import WeightsInfo, save_random_weights
from backplane.cli.bench.options import (
    add_json_output,
    csv_list,
    csv_or_none,
    family_backend,
    int_list,
)
from backplane.core.errors import BackplaneError

__all__ = [
    "SHAPES",
    "BackplaneError",
    "Settings",
    "WeightsInfo",
    "add_arguments",
    "floor_bytes",
    "format_report",
    "load_result",
    "measure_bandwidth",
    "merge_results",
    "run_benchmark",
    "run_cli",
    "run_shape",
    "save_random_weights",
    "settings_from_args",
    "shape_config",
    "write_plot",
]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``backplane bench latency`` to ``parser``.

    :param parser: the sub-command's parser.
    """
    parser.add_argument(
        "--shapes",
        type=csv_list,
        default=list(DEFAULT_SHAPES),
        metavar="NAME,...",
        help=f"model shapes: {', '.join(SHAPES)}, a preset such as tiny-llama, a model "
        "directory (config.json + safetensors), a .gguf file or an installed model such as "
        f"smollm2 (default: {','.join(DEFAULT_SHAPES)})",
    )
    parser.add_argument(
        "--batch-sizes",
        type=int_list("1,8"),
        default=[1, 8],
        metavar="B,...",
        help="(default: 1,8)",
    )
    parser.add_argument("--prompt-len", type=int, default=512, metavar="N", help="(default: 512)")
    parser.add_argument(
        "--new-tokens", type=int, default=128, metavar="N", help="tokens generated (default: 128)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--attention",
        type=csv_or_none,
        default=list(ATTENTION_BACKENDS),
        metavar="NAME,...",
        help="backplane attention backends to measure, or none (default: torch,triton,flashinfer)",
    )
    parser.add_argument(
        "--cuda-graphs",
        type=csv_list,
        default=list(GRAPH_MODES),
        metavar="on,off",
        help="backplane with CUDA graphs on (the default mode) and/or off (default: on,off)",
    )
    parser.add_argument(
        "--transformers",
        type=csv_or_none,
        default=list(TRANSFORMERS_MODES),
        metavar="MODES",
        help="transformers runs: eager, compile (static cache + torch.compile), both "
        "(default: eager,compile) or none",
    )
    parser.add_argument(
        "--backend",
        type=family_backend,
        action="append",
        default=[],
        metavar="FAMILY=NAME",
        help="backplane backend of another op family, e.g. ssm=triton (default: auto)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per point; the median is shown (3)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before them (1)")
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split each backplane engine over N GPUs (one worker process per rank; "
        "transformers runs on one device) (default: 1)",
    )
    parser.add_argument(
        "--custom-all-reduce",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with -tp > 1, sum small all-reduces with the one-shot kernel (default, the "
        "engine option custom_all_reduce) or, with --no-custom-all-reduce, with NCCL",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (0)")
    parser.add_argument(
        "--speculative-config",
        type=parse_speculative_config,
        default=None,
        metavar="JSON",
        help="also measure each backplane configuration with speculative decoding, spelled "
        'as for serve, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"method": "mtp", "num_speculative_tokens": 1}\' (on a shape with MTP layers); '
        "reports effective ms per generated token, x floor, speedup over the same "
        "configuration without speculation, acceptance rate and mean accepted length",
    )
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="random",
        help="prompts: random tokens, or rewrite (a trained checkpoint is asked in a chat "
        "turn to rewrite an English paragraph, its prompt length that prompt's; a random "
        "shape gets a random document repeated), which prompt lookup drafts (default: random)",
    )
    parser.add_argument(
        "--compile-on-cpu",
        action="store_true",
        help="also measure transformers static+compile on a CPU (slow to compile)",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="fp8: backplane's engines quantise the saved projections to FP8 (e4m3) on load, "
        "and the floor counts their bytes (the unquantised floor is kept beside it); "
        "transformers rows are skipped (default: none)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="backplane's KV cache: auto (the run's dtype) or fp8 (e4m3, one byte an "
        "element in the floor) (default: auto)",
    )
    parser.add_argument(
        "--weights-format",
        choices=WEIGHTS_FORMATS,
        default="safetensors",
        help="how a random-weight shape is saved: safetensors (an HF folder) or gguf-q4_k "
        "(a GGUF file of a llama-family shape: Q4_K projections, Q6_K output head, F16 "
        "embedding; kept in --weights-dir; transformers rows are skipped) "
        "(default: safetensors)",
    )
    parser.add_argument(
        "--weights-dir",
        metavar="DIR",
        help="keep the saved random-weight HF folders and GGUF files here, to reuse them "
        "(default: a temporary folder)",
    )
    add_json_output(parser)
    parser.add_argument(
        "--plot", metavar="PATH", help="write a PNG of ms/token against batch size (matplotlib)"
    )
    parser.add_argument(
        "--plot-from",
        nargs="+",
        metavar="JSON",
        help="measure nothing: print the report of saved --json results (several are "
        "merged, e.g. one per shape) and plot them (to --plot, default: the first JSON's "
        "name with .png)",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Build :class:`Settings` from parsed ``bench latency`` flags.

    :param args: what :func:`add_arguments`' flags parsed to.
    :return: the run's settings.
    """
    return Settings(
        shapes=list(args.shapes),
        batch_sizes=list(args.batch_sizes),
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        device=args.device,
        dtype=args.dtype,
        attention_backends=list(args.attention),
        cuda_graphs=list(args.cuda_graphs),
        transformers_modes=list(args.transformers),
        backends=dict(args.backend),
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
        compile_on_cpu=args.compile_on_cpu,
        weights_dir=args.weights_dir,
        tensor_parallel_size=args.tensor_parallel_size,
        custom_all_reduce=args.custom_all_reduce,
        speculative_config=args.speculative_config,
        workload=args.workload,
        quantization=None if args.quantization == "none" else args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        weights_format=args.weights_format,
    )


def run_cli(args: argparse.Namespace) -> int:
    """Run ``backplane bench latency``: print the report, write ``--json`` / ``--plot``.

    :param args: the parsed flags.
    :return: the exit code (0).
    :raises BackplaneError: a user error (bad settings, unreadable ``--plot-from``
        file, no matplotlib for ``--plot``).
    """
    if args.plot_from:
        result = merge_results([load_result(p) for p in args.plot_from])
        print(format_report(result), end="")
        plot = args.plot or str(Path(args.plot_from[0]).with_suffix(".png"))
        write_plot(result, plot)
        logger.info("wrote %s", plot)
        return 0
    if args.plot:
        # fail before measuring for minutes, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise matplotlib_missing(
                ", or drop --plot and use --plot-from on the --json file elsewhere"
            ) from None
    result = run_benchmark(settings_from_args(args))
    print(format_report(result), end="")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        logger.info("wrote %s", args.json)
    if args.plot:
        write_plot(result, args.plot)
        logger.info("wrote %s", args.plot)
    return 0
