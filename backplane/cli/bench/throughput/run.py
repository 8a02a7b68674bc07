"""One ``backplane bench throughput`` run: check the flags, build the engine, measure."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import time
from typing import Any

from backplane.cli.bench.anchors import throughput_comparisons
from backplane.cli.bench.latency.engines import quiet_missing_tokenizer
from backplane.cli.bench.latency.floor import measure_bandwidth
from backplane.cli.bench.latency.measure import free_device_memory, skipped
from backplane.cli.bench.latency.shard import rank_weights_info
from backplane.cli.bench.latency.weights import weights_workdir
from backplane.cli.bench.machine import machine_info
from backplane.cli.bench.throughput.decode import decode_only
from backplane.cli.bench.throughput.model import resolve_model
from backplane.cli.bench.throughput.rates import lengths_summary, make_specs, run_rates
from backplane.cli.bench.throughput.reference import transformers_batch
from backplane.cli.bench.workload import (
    parse_rates,
)
from backplane.cli.options import config_from_args
from backplane.core.errors import ConfigError

logger = logging.getLogger(__name__)


def _check_args(args: argparse.Namespace) -> None:
    """Refuse flags that cannot be measured, before an engine is built."""
    if args.num_prompts < 1:
        raise ConfigError("option --num-prompts: must be at least 1")
    for name in ("input_len", "output_len"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"option --{name.replace('_', '-')}: must be at least 1")
    if min(args.max_input_len, args.max_output_len) < 4:
        raise ConfigError("options --max-input-len / --max-output-len: must be at least 4")
    if args.warmup_prompts < 0:
        raise ConfigError("option --warmup-prompts: must be at least 0")
    if args.decode_batch_sizes and min(args.decode_batch_sizes) < 1:
        raise ConfigError("option --decode-batch-sizes: give positive integers, or none")
    if args.decode_steps < 2:
        raise ConfigError(
            "option --decode-steps: at least 2 (the time per step is measured between the "
            "first token and the last)"
        )
    if args.decode_prompt_len < 1:
        raise ConfigError("option --decode-prompt-len: must be at least 1")


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Measure everything ``backplane bench throughput`` reports, in this process.

    :param args: the parsed flags (:func:`add_arguments`).
    :return: the JSON-ready result: ``machine``, ``model``, ``engine``,
        ``workload``, ``rates`` (one row per rate), ``transformers``, ``decode``.
    :raises ConfigError: bad flags (before anything is built).
    """
    from backplane.api import LLM, AsyncLLM

    _check_args(args)
    rates = parse_rates(args.request_rate, "--request-rate")
    config = config_from_args(args)
    decode_batches = sorted(set(args.decode_batch_sizes))
    if decode_batches and config.origin("max_num_seqs").kind == "default":
        biggest = max(decode_batches)
        if biggest > config.max_num_seqs_resolved:
            config = config.merge(
                max_num_seqs=biggest, max_num_tokens=max(config.max_num_tokens_resolved, biggest)
            )
            logger.info("max_num_seqs %d: the largest decode-only batch", biggest)
    if config.origin("enable_prefix_caching").kind == "default":
        # every rate (and the warm-up) sends the same prompts again: hits would skip prefills
        config = config.merge(enable_prefix_caching=False)
    device, dtype = config.torch_device, config.torch_dtype
    seed = int(config.seed)
    result: dict[str, Any] = {"machine": machine_info(device)}
    bandwidth: dict[str, Any] | None = None
    if device.type == "cuda" and decode_batches:
        bandwidth = measure_bandwidth(device)  # before the engine takes the memory
        logger.info(
            "read bandwidth %.1f GB/s (%s)", bandwidth["bytes_per_s"] / 1e9, bandwidth["method"]
        )
    with contextlib.ExitStack() as stack:
        workdir = weights_workdir(stack, args.weights_dir, "bench-throughput-")
        model = resolve_model(config.model, dtype, workdir)
        config = config.merge(model=model.source)
        t0 = time.perf_counter()
        with quiet_missing_tokenizer():
            llm = LLM(config=config)
        engine = llm.engine
        result["model"] = {
            "name": model.name,
            "source": model.source if model.source != model.name else None,
            "architecture": type(engine.model).__name__,
            "params": model.weights.params if model.weights else None,
            "weight_bytes": model.weights.weight_bytes if model.weights else None,
        }
        resolved = config.resolved().to_dict()
        # the engine's own limits: a model with recurrent state may run fewer sequences
        resolved.update(max_num_seqs=engine.max_num_seqs, max_num_tokens=engine.max_num_tokens)
        result["engine"] = {
            "config": resolved,
            "backends": {
                f: getattr(b, "name", type(b).__name__) for f, b in engine.backends.items()
            },
            "max_model_len": engine.max_model_len,
            "startup_s": time.perf_counter() - t0,
        }
        specs = make_specs(args, seed, engine.vocab_size, engine.max_model_len)
        result["workload"] = {
            "num_prompts": len(specs),
            "mix": "sharegpt-like"
            if args.input_len is None or args.output_len is None
            else "fixed",
            "input_len": args.input_len,
            "output_len": args.output_len,
            "seed": seed,
            "request_rates": [r if math.isfinite(r) else "inf" for r in rates],
            "warmup_prompts": args.warmup_prompts,
            "prompt_tokens": lengths_summary([len(s.prompt_token_ids) for s in specs]),
            "output_tokens": lengths_summary([s.output_len for s in specs]),
        }

        floor_reason = None
        if not decode_batches:
            floor_reason = "no decode-only batch sizes"
        elif device.type != "cuda":
            floor_reason = f"the HBM floor needs a CUDA device (this run is on {device.type})"
        elif model.weights is None:
            floor_reason = (
                "the floor needs the weights' sizes, known for the shapes, the presets and "
                f"model directories of safetensors files (not {model.name!r})"
            )
        try:
            decode_rows = decode_only(
                llm,
                decode_batches,
                prompt_len=args.decode_prompt_len,
                steps=args.decode_steps,
                seed=seed,
                # the ranks read their shards at once: the floor is one rank's bytes
                weights=rank_weights_info(model.weights, dtype, config.tensor_parallel_size)
                if floor_reason is None and model.weights is not None
                else None,
                bandwidth=bandwidth["bytes_per_s"] if bandwidth else None,
            )
            async_engine = AsyncLLM(llm=llm)
        except BaseException:
            llm.shutdown()
            raise
        try:
            rows = run_rates(async_engine, specs, rates, seed, args.warmup_prompts)
        finally:
            async_engine.shutdown()
            del llm, engine, async_engine
            free_device_memory(device)
        result["rates"] = rows
        result["decode"] = {
            "prompt_len": args.decode_prompt_len,
            "steps": args.decode_steps,
            "bandwidth": bandwidth,
            "floor_per_rank_of": int(config.tensor_parallel_size),
            "floor_skipped": floor_reason,
            "batches": decode_rows,
        }
        if args.transformers:
            hf = transformers_batch(model, specs, rates, device, dtype)
        else:
            hf = skipped("--no-transformers")
        inf_row = next((r for r in rows if r["rate"] == "inf"), None)
        if hf["status"] == "ok" and inf_row and hf["output_token_throughput"] > 0:
            hf["backplane_ratio"] = (
                inf_row["output_token_throughput"] / hf["output_token_throughput"]
            )
        result["transformers"] = hf
    result["anchors"] = throughput_comparisons(result)
    return result
