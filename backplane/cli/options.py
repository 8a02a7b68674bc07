"""The engine flags of the command line (``--config``, ``--model``, ``--backend``...).

Flags not given on the command line keep the value of the ``--config`` file, or
the default; an error names the flag (or the file and key) it came from.
"""

from __future__ import annotations

import argparse
from typing import Any

from backplane.core.errors import ConfigError
from backplane.core.hookspecs import FAMILIES
from backplane.engine.config import CUDA_GRAPH_MODES, FUSED_OPS_MODES, ConfigSource, EngineConfig


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags to ``parser``, in an argument group of their own.

    Every flag but ``--config`` is left out of the parsed namespace when not
    given, so that it does not override the file. Build the configuration with
    :func:`config_from_args`.

    :param parser: the (sub-)command's parser.
    """
    group = parser.add_argument_group("engine configuration")
    sup = argparse.SUPPRESS
    group.add_argument(
        "--config", metavar="FILE", default=None, help="YAML file of engine settings"
    )
    group.add_argument("--model", default=sup, help="model directory or preset name")
    group.add_argument("--dtype", default=sup, help="auto | float32 | bfloat16 | float16")
    group.add_argument("--device", default=sup, help="auto | cpu | cuda | cuda:N")
    group.add_argument(
        "--quantization",
        default=sup,
        metavar="METHOD",
        help="fp8: quantise a full-precision checkpoint's projections on load",
    )
    group.add_argument(
        "--kv-cache-dtype", default=sup, help="auto (the model's dtype) | fp8 (e4m3)"
    )
    group.add_argument(
        "--max-num-seqs",
        default=sup,
        metavar="N",
        help="sequences per step (default: 1024 on a GPU of 70 GiB or more, 256 on a smaller one "
        "or for a model with recurrent state, 32 on a CPU)",
    )
    group.add_argument(
        "--max-num-tokens",
        default=sup,
        metavar="N",
        help="tokens per step, the prefill chunk (default: 8192 on CUDA, 2048 on a CPU)",
    )
    group.add_argument("--max-model-len", default=sup, metavar="N", help="longest prompt + output")
    group.add_argument("--page-size", default=sup, metavar="N", help="tokens per KV page")
    group.add_argument(
        "--kv-memory", default=sup, metavar="SIZE", help="KV cache memory, e.g. 256MiB"
    )
    group.add_argument(
        "--gpu-memory-utilization",
        default=sup,
        metavar="F",
        help="fraction of the GPU's memory for the engine in all (default 0.9); the KV cache "
        "gets what weights, activations and graphs leave",
    )
    group.add_argument(
        "--num-kv-pages", default=sup, metavar="N", help="exact KV page count (overrides)"
    )
    group.add_argument(
        "--host-kv-memory",
        default=sup,
        metavar="SIZE",
        help="pinned host memory for offloaded KV blocks (0 = off)",
    )
    group.add_argument(
        "--prefix-caching",
        dest="enable_prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=sup,
        help="reuse KV blocks of shared prompt prefixes",
    )
    group.add_argument(
        "--cuda-graphs", default=sup, help=" | ".join(CUDA_GRAPH_MODES) + " (default by device)"
    )
    group.add_argument(
        "--cuda-graph-buckets",
        default=sup,
        metavar="N,N,...",
        help="token counts to capture graphs for",
    )
    group.add_argument(
        "--fused-ops",
        default=sup,
        help=" | ".join(FUSED_OPS_MODES) + ": the models' elementwise work (RMS norm with "
        "the residual add, gated activations, rotary); triton = one Triton kernel each "
        "(needs CUDA and triton), torch = plain torch ops, auto (default) = triton on CUDA "
        "when triton imports",
    )
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=sup,
        help="prepare the next step while the device runs the current one (default: on)",
    )
    group.add_argument(
        "--threads",
        default=sup,
        metavar="N",
        help="torch CPU threads (default: the cores this process may use); fewer than the "
        "cores leaves a core to other processes",
    )
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        default=sup,
        metavar="N",
        help="split the model over N devices, one worker process each (default: 1)",
    )
    group.add_argument(
        "--distributed-executor-backend",
        default=sup,
        metavar="NAME",
        help="how tensor-parallel workers start: mp (processes on this machine, default) or "
        "ray (actors on a Ray cluster: pip install 'backplane[ray]')",
    )
    group.add_argument(
        "--custom-all-reduce",
        action=argparse.BooleanOptionalAction,
        default=sup,
        help="sum small tensor-parallel all-reduces (decode rows) with a one-shot kernel "
        "reading the peers' buffers over NVLink instead of NCCL (default: on; "
        "--no-custom-all-reduce keeps them on NCCL)",
    )
    group.add_argument(
        "--data-parallel-size",
        "-dp",
        default=sup,
        metavar="N",
        help="engine replicas behind the server, requests balanced by load; on CUDA replica i "
        "runs on GPUs i*TP .. i*TP+TP-1 from --device (default: 1)",
    )
    group.add_argument(
        "--speculative-config",
        default=sup,
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 4}\' (methods: ngram, draft_model with "model", mtp)',
    )
    group.add_argument("--seed", default=sup, metavar="N", help="sampling seed")
    group.add_argument("--debug", action="store_true", default=sup, help="extra checks and logging")
    group.add_argument(
        "--backend",
        dest="backend_choices",
        action="append",
        default=sup,
        metavar="FAMILY=NAME",
        help=f"backend per op family ({', '.join(FAMILIES)}); repeatable; NAME may be auto",
    )


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the engine configuration from flags added by :func:`add_engine_arguments`.

    :param args: the parsed namespace; ``--config FILE`` is loaded first, then
        every flag that was given overrides it.
    :return: the validated configuration.
    :raises ConfigError: naming the file and key, or the flag.
    """
    config_file = getattr(args, "config", None)
    base = EngineConfig.from_yaml(config_file) if config_file else EngineConfig()
    given = vars(args)
    values: dict[str, Any] = {}
    for name in EngineConfig.field_names():
        if name != "backends" and name in given:
            values[name] = given[name]
    if "backend_choices" in given:
        backends: dict[str, str] = {}
        for item in given["backend_choices"] or []:
            family, sep, name = item.partition("=")
            if not sep or not family.strip() or not name.strip():
                raise ConfigError(
                    f"option --backend: expected FAMILY=NAME (e.g. attention=torch), got {item!r}"
                )
            backends[family.strip()] = name.strip()
        values["backends"] = backends
    if not values:
        return base
    return EngineConfig.from_dict(values, source=ConfigSource("cli"), base=base)
