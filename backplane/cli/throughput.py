"""``backplane bench throughput``: offline serving throughput in one process.

One engine, built from the usual engine flags, measured three ways in one run:

1. **Requests at a rate**: ``--num-prompts`` requests from a seeded synthetic
   mix of prompt and output lengths shaped like ShareGPT conversations
   (:func:`backplane.cli.workload.sharegpt_like_requests`; ``--input-len`` /
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
``nemotron-h-0.85b``) and the built-in presets (``tiny-llama`` ...), whose
fixed-seed random weights are saved once as a Hugging Face folder that both
backplane and transformers load, as well as ``smollm2``, a model directory or
a ``.gguf`` file. When ``--max-num-seqs`` is not given, the engine takes the
largest decode batch as its sequence limit; prefix caching is off unless
``--prefix-caching`` is given (each rate sends the same prompts again).
``--seed`` seeds the request mix, the arrivals and the engine's sampling.

Examples::

    backplane bench throughput --model llama-1b --input-len 512 --output-len 128 \\
        --num-prompts 32 --backend attention=triton --json t.json --plot t.png
    backplane bench throughput --model llama-1b --num-prompts 1000 --request-rate 4,16,64,inf
    backplane bench throughput --model tiny-llama --device cpu --num-prompts 8 \\
        --input-len 16 --output-len 8 --decode-batch-sizes 4,8   # a CPU check
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backplane.cli.latency.engines import generate_backplane, quiet_missing_tokenizer
from backplane.cli.latency.floor import floor_bytes, measure_bandwidth
from backplane.cli.latency.machine import machine_info
from backplane.cli.latency.measure import free_device_memory, make_prompts, one_line, skipped
from backplane.cli.latency.reference import generate_transformers, load_transformers_model
from backplane.cli.latency.shapes import SHAPES, shape_config
from backplane.cli.latency.weights import WeightsInfo, save_random_weights
from backplane.cli.options import add_engine_arguments, config_from_args
from backplane.cli.workload import (
    RequestResult,
    RequestSpec,
    arrival_offsets,
    parse_rates,
    print_table,
    sharegpt_like_requests,
    summarize,
)
from backplane.core.errors import BackplaneError, ConfigError

logger = logging.getLogger(__name__)

__all__ = ["add_arguments", "run_cli", "run_throughput"]

DECODE_BATCH_SIZES: tuple[int, ...] = (64, 128, 256)
"""Batch sizes of the decode-only measurement by default."""


@dataclass
class Model:
    """The model an engine is built from, and what the other measurements need of it.

    :param name: what ``--model`` said.
    :param source: what the engine loads (a saved folder for shapes and presets).
    :param weights: the saved weights' sizes (``None``: the floor cannot be computed).
    :param hf_folder: a Hugging Face folder transformers can load, else ``None``.
    :param why_no_hf: why transformers cannot load the model (when ``hf_folder`` is ``None``).
    """

    name: str
    source: str
    weights: WeightsInfo | None
    hf_folder: str | None
    why_no_hf: str | None = None


def _ints(value: str) -> list[int]:
    """Parse ``64,128`` as ``[64, 128]`` and ``none`` as ``[]``."""
    if value.strip().lower() == "none":
        return []
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 64,128,256 (or none), got {value!r}"
        ) from None


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
        type=_ints,
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
    parser.add_argument("--json", metavar="PATH", help="write every figure and the machine here")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG of output tokens/s against request rate and decode batch (matplotlib)",
    )
    add_engine_arguments(parser)


# -- the model ------------------------------------------------------------------------------------


def resolve_model(name: str, dtype: Any, workdir: str) -> Model:
    """Turn ``--model`` into what the engine loads and what transformers and the floor need.

    :param name: a shape of the latency benchmark, a built-in preset, ``smollm2``,
        a directory or a ``.gguf`` file.
    :param dtype: the ``torch.dtype`` to save random weights in.
    :param workdir: where random weights are saved.
    :return: the model's sources.
    """
    from backplane.models import presets

    if name in SHAPES or name in presets.PRESETS:
        folder = os.path.join(workdir, f"{name}-{str(dtype).replace('torch.', '')}")
        t0 = time.perf_counter()
        logger.info("%s: saving fixed-seed random weights in %s", name, folder)
        info = save_random_weights(name, shape_config(name), folder, dtype)
        logger.info("%s: saved in %.1fs", name, time.perf_counter() - t0)
        return Model(name, info.folder, info, info.folder)
    path = Path(name)
    if path.is_dir() and (path / "config.json").is_file():
        return Model(name, name, None, name)
    return Model(
        name,
        name,
        None,
        None,
        f"transformers loads a Hugging Face folder (config.json + safetensors); {name!r} is not one",
    )


# -- requests through AsyncLLM --------------------------------------------------------------------


async def _one_request(
    engine: Any,
    spec: RequestSpec,
    start: float,
    delay: float,
    record: dict[str, Any],
    progress: Any,
) -> RequestResult:
    """Send one request ``delay`` seconds after ``start`` and time its stream.

    :param engine: the :class:`~backplane.api.AsyncLLM`.
    :param spec: the request.
    :param start: the run's start (``time.perf_counter``).
    :param delay: seconds from the run's start to its arrival.
    :param record: filled with the request's lengths, finish reason and times.
    :param progress: a ``tqdm`` bar, advanced when it ends.
    :return: what it measured.
    """
    from backplane.engine.sampling import SamplingParams

    wait = start + delay - time.perf_counter()
    if wait > 0:
        await asyncio.sleep(wait)
    params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
    res = RequestResult(ok=False, prompt_tokens=len(spec.prompt_token_ids))
    finish: str | None = None
    sent = time.perf_counter()
    last: float | None = None
    try:
        stream = await engine.add_request(spec.prompt_token_ids, params)
        async for out in stream:
            now = time.perf_counter()
            k = len(out.new_token_ids)
            if k:
                if last is None:
                    res.ttft = now - sent
                    res.itls.extend([0.0] * (k - 1))  # delivered with the first token
                else:
                    res.itls.extend([(now - last) / k] * k)
                last = now
                res.output_tokens += k
            if out.finished:
                finish = out.finish_reason
        res.e2e = time.perf_counter() - sent
        res.ok = res.ttft is not None and finish == "length"
        if not res.ok:
            res.error = f"finished with {finish!r} after {res.output_tokens} tokens"
    except BackplaneError as exc:
        res.error = one_line(exc)
    record.update(
        {
            "prompt_len": len(spec.prompt_token_ids),
            "output_len": spec.output_len,
            "output_tokens": res.output_tokens,
            "finish_reason": finish,
            "ttft_ms": None if res.ttft is None else res.ttft * 1e3,
            "e2e_ms": None if res.e2e is None else res.e2e * 1e3,
            "arrival_s": delay,
        }
    )
    if progress is not None:
        progress.update(1)
    return res


async def _run_requests(
    engine: Any, specs: list[RequestSpec], rate: float, seed: int, progress: Any
) -> tuple[list[RequestResult], list[dict[str, Any]], float]:
    """Send ``specs`` at ``rate`` and wait for all of them.

    :param engine: the :class:`~backplane.api.AsyncLLM`.
    :param specs: the requests, in arrival order.
    :param rate: requests per second (``inf``: all at once).
    :param seed: the seed of the arrival gaps.
    :param progress: a ``tqdm`` bar or ``None``.
    :return: each request's result and record, in the order of ``specs``, and the
        wall seconds from the first arrival to the last token.
    """
    offsets = arrival_offsets(len(specs), rate, seed)
    records: list[dict[str, Any]] = [{} for _ in specs]
    start = time.perf_counter()
    tasks = [
        _one_request(engine, spec, start, float(off), rec, progress)
        for spec, off, rec in zip(specs, offsets, records, strict=True)
    ]
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return list(results), records, duration


def run_rates(
    engine: Any, specs: list[RequestSpec], rates: list[float], seed: int, warmup: int
) -> list[dict[str, Any]]:
    """Run the requests at each rate on one engine; one :func:`summarize` row per rate.

    :param engine: the :class:`~backplane.api.AsyncLLM`.
    :param specs: the requests.
    :param rates: requests per second (``inf``: all at once).
    :param seed: the seed of the arrivals (rate ``i`` uses ``seed + i``).
    :param warmup: untimed requests (the first ones of ``specs``, all at once) first.
    :return: the rows, each with its per-request ``requests`` records and whether
        every request produced exactly its output length (``exact_lengths``).
    """
    from tqdm.auto import tqdm

    if warmup > 0:
        logger.info("warm-up: %d requests at once", min(warmup, len(specs)))
        asyncio.run(_run_requests(engine, specs[:warmup], math.inf, seed, None))
    rows = []
    for i, rate in enumerate(rates):
        label = "inf" if not math.isfinite(rate) else f"{rate:g}"
        with tqdm(total=len(specs), desc=f"rate {label}", unit="req", disable=None) as bar:
            results, records, duration = asyncio.run(
                _run_requests(engine, specs, rate, seed + i, bar)
            )
        row = summarize(rate, results, duration)
        row["exact_lengths"] = all(r["output_tokens"] == r["output_len"] for r in records)
        row["requests_detail"] = records
        rows.append(row)
    return rows


# -- transformers on the same batch ---------------------------------------------------------------


def transformers_batch(
    model: Model, specs: list[RequestSpec], rates: list[float], device: Any, dtype: Any
) -> dict[str, Any]:
    """transformers ``generate`` over every request at once, where that is the same work.

    :param model: the model (its HF folder).
    :param specs: the requests.
    :param rates: the rates measured (one must be ``inf``).
    :param device: the ``torch.device``.
    :param dtype: the ``torch.dtype``.
    :return: ``status``, and when measured ``output_token_throughput``,
        ``total_token_throughput``, ``duration_s``, ``ttft_ms``, ``ms_per_step``
        and ``tokens_per_request``; else ``reason``.
    """
    if all(math.isfinite(r) for r in rates):
        return skipped(
            "requests arrive at a rate; transformers generate runs one batch at once "
            "(add inf to --request-rate)"
        )
    out_lens = {s.output_len for s in specs}
    if len(out_lens) != 1:
        return skipped(
            "the requests' output lengths differ; transformers generate gives every row of a "
            "batch one length (pass --output-len)"
        )
    if model.hf_folder is None:
        return skipped(model.why_no_hf or "no Hugging Face folder")
    import torch

    try:
        hf = load_transformers_model(model.hf_folder, device, dtype)
    except ImportError as exc:
        return skipped(f"transformers is not installed ({exc}); pip install transformers")
    except Exception as exc:
        logger.debug("transformers failed to load %s", model.hf_folder, exc_info=True)
        return skipped(f"transformers cannot load the model: {one_line(exc)}")
    n_out = out_lens.pop()
    lens = [len(s.prompt_token_ids) for s in specs]
    width = max(lens)
    pad = hf.generation_config.pad_token_id
    if pad is None:
        eos = hf.generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    ids = torch.full((len(specs), width), int(pad), dtype=torch.long)
    mask = torch.zeros((len(specs), width), dtype=torch.long)
    for i, s in enumerate(specs):  # padded on the left, as generate expects
        ids[i, width - lens[i] :] = torch.tensor(s.prompt_token_ids, dtype=torch.long)
        mask[i, width - lens[i] :] = 1
    ids, mask = ids.to(device), mask.to(device)
    entry: dict[str, Any] = {
        "attn_implementation": getattr(hf.config, "_attn_implementation", None),
        "batch": len(specs),
        "padded_prompt_len": width,
        "output_len": n_out,
    }
    try:
        generate_transformers(hf, ids, min(n_out, 2), {}, mask)  # warm-up
        t0 = time.perf_counter()
        ttft, per_token, tokens = generate_transformers(hf, ids, n_out, {}, mask)
        wall = time.perf_counter() - t0
    except Exception as exc:
        logger.debug("transformers generate failed", exc_info=True)
        entry.update({"status": "failed", "reason": one_line(exc)})
        return entry
    finally:
        del hf, ids, mask
        free_device_memory(device)
    counts = [len(t) for t in tokens]
    produced = sum(counts)
    entry.update(
        {
            "status": "ok",
            "duration_s": wall,
            "output_tokens": produced,
            "output_token_throughput": produced / wall,
            "total_token_throughput": (produced + sum(lens)) / wall,
            "ttft_ms": ttft * 1e3,
            "ms_per_step": per_token * 1e3,
            "tokens_per_request": counts,
        }
    )
    if any(c != n_out for c in counts):
        entry["status"] = "failed"
        entry["reason"] = f"produced {counts} tokens per request instead of {n_out} each"
    return entry


# -- decode only ----------------------------------------------------------------------------------


def decode_only(
    llm: Any,
    batches: list[int],
    *,
    prompt_len: int,
    steps: int,
    seed: int,
    weights: WeightsInfo | None,
    bandwidth: float | None,
) -> list[dict[str, Any]]:
    """Decode throughput at each batch size: every sequence prefills, then all decode together.

    Each batch runs once untimed and once timed through ``LLM.generate``; ms per
    step is ``(time of the last token - time of the first) / (steps - 1)``, the
    same measure as ``backplane bench latency``.

    :param llm: the engine's :class:`~backplane.api.LLM` (not driven by anything else).
    :param batches: the batch sizes.
    :param prompt_len: prompt tokens per sequence.
    :param steps: tokens each sequence decodes.
    :param seed: the prompts' seed.
    :param weights: the saved weights' sizes, for the floor (``None``: no floor).
    :param bandwidth: the measured read bandwidth, bytes/s (``None``: no floor).
    :return: one row per batch size: ``status``, ``ms_per_step``, ``tokens_per_s``,
        ``ttft_ms``, ``tokens_per_request`` and, with a floor, ``floor_ms_per_step``,
        ``floor_tokens_per_s``, ``x_floor`` and ``floor_bytes``; or ``reason``.
    """
    from tqdm.auto import tqdm

    engine = llm.engine
    pool = engine.kv_manager.pool
    kv_tokens = int(pool.num_usable) * int(engine.page_size)
    rows = []
    for b in tqdm(batches, desc="decode-only", unit="batch", disable=None):
        row: dict[str, Any] = {"batch": b}
        need = -(-(prompt_len + steps) // engine.page_size) * engine.page_size * b
        if b > engine.max_num_seqs:
            row.update(
                status="skipped",
                reason=f"max_num_seqs is {engine.max_num_seqs}; pass --max-num-seqs {b}",
            )
        elif prompt_len + steps > engine.max_model_len:
            row.update(
                status="skipped",
                reason=f"prompt {prompt_len} + {steps} steps exceed max_model_len "
                f"{engine.max_model_len}",
            )
        elif need > kv_tokens:
            row.update(
                status="skipped",
                reason=f"the KV cache holds {kv_tokens} tokens, fewer than the {need} "
                f"this batch needs; give it more memory (--kv-memory, "
                "--gpu-memory-utilization)",
            )
        else:
            prompts = make_prompts(seed, b, prompt_len, engine.vocab_size)
            try:
                generate_backplane(llm, prompts, steps)
                _, per_step, tokens = generate_backplane(llm, prompts, steps)
                counts = [len(t) for t in tokens]
                row.update(
                    status="ok",
                    ms_per_step=per_step * 1e3,
                    tokens_per_s=b / per_step if per_step > 0 else None,
                    tokens_per_request=counts,
                )
                if any(c != steps for c in counts):
                    row.update(
                        status="failed",
                        reason=f"produced {sorted(set(counts))} tokens per sequence, not {steps}",
                    )
            except Exception as exc:
                logger.debug("decode-only batch %d failed", b, exc_info=True)
                row.update(status="failed", reason=one_line(exc))
        if row["status"] == "ok" and weights is not None and bandwidth:
            parts = floor_bytes(weights, b, prompt_len, steps)
            floor_ms = parts["total"] / bandwidth * 1e3
            row.update(
                floor_ms_per_step=floor_ms,
                floor_tokens_per_s=b / floor_ms * 1e3,
                x_floor=row["ms_per_step"] / floor_ms,
                floor_bytes=parts,
            )
        rows.append(row)
    return rows


# -- the run --------------------------------------------------------------------------------------


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


def _make_specs(args: argparse.Namespace, seed: int, vocab: int, max_len: int) -> list[RequestSpec]:
    """The requests of the run: the ShareGPT-like mix, with the lengths the flags fix.

    :raises ConfigError: fixed lengths that do not fit ``max_len``.
    """
    total = min(2048, max_len)
    fixed_in, fixed_out = args.input_len, args.output_len
    if (fixed_in or 4) + (fixed_out or 4) > max_len:
        raise ConfigError(
            f"--input-len {fixed_in} + --output-len {fixed_out} exceed the engine's "
            f"max_model_len {max_len}"
        )
    try:
        return sharegpt_like_requests(
            args.num_prompts,
            seed=seed,
            max_input_len=args.max_input_len,
            max_output_len=args.max_output_len,
            max_total_len=total if fixed_in is None else max_len,
            token_id_range=(0, vocab),
            input_len=fixed_in,
            output_len=fixed_out,
        )
    except ValueError as exc:
        raise ConfigError(f"the request mix: {exc}") from None


def _lengths_summary(values: list[int]) -> dict[str, float]:
    """Mean, median, min and max of a list of lengths."""
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


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
        if biggest > config.max_num_seqs:
            config = config.merge(
                max_num_seqs=biggest, max_num_tokens=max(config.max_num_tokens, biggest)
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
        if args.weights_dir:
            workdir = args.weights_dir
            os.makedirs(workdir, exist_ok=True)
        else:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-throughput-"))
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
        result["engine"] = {
            "config": config.resolved().to_dict(),
            "backends": {
                f: getattr(b, "name", type(b).__name__) for f, b in engine.backends.items()
            },
            "max_model_len": engine.max_model_len,
            "startup_s": time.perf_counter() - t0,
        }
        specs = _make_specs(args, seed, engine.vocab_size, engine.max_model_len)
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
            "prompt_tokens": _lengths_summary([len(s.prompt_token_ids) for s in specs]),
            "output_tokens": _lengths_summary([s.output_len for s in specs]),
        }

        floor_reason = None
        if not decode_batches:
            floor_reason = "no decode-only batch sizes"
        elif device.type != "cuda":
            floor_reason = f"the HBM floor needs a CUDA device (this run is on {device.type})"
        elif model.weights is None:
            floor_reason = (
                "the floor needs the weights' sizes, known for the shapes and presets whose "
                f"weights this command saves (not {model.name!r})"
            )
        try:
            decode_rows = decode_only(
                llm,
                decode_batches,
                prompt_len=args.decode_prompt_len,
                steps=args.decode_steps,
                seed=seed,
                weights=model.weights if floor_reason is None else None,
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
    return result


# -- report ---------------------------------------------------------------------------------------


def format_header(result: dict[str, Any]) -> str:
    """The lines that say what was measured: machine, model, engine and workload.

    :param result: :func:`run_throughput`'s result.
    :return: the text, ending with a newline.
    """
    m, mod, eng, w = result["machine"], result["model"], result["engine"], result["workload"]
    cfg = eng["config"]
    where = m["gpu"] or f"{m['cpu']} ({m['cores']} cores)"
    backends = ", ".join(f"{f}={b}" for f, b in eng["backends"].items())
    p, o = w["prompt_tokens"], w["output_tokens"]
    lines = [
        f"machine: {where}, torch {m['torch']}",
        f"model: {mod['name']} ({mod['architecture']}), {cfg['dtype']} on {cfg['device']}",
        f"engine: {backends}; cuda_graphs {cfg['cuda_graphs']}, max_num_seqs "
        f"{cfg['max_num_seqs']}, max_num_tokens {cfg['max_num_tokens']}, max_model_len "
        f"{eng['max_model_len']}",
        f"requests: {w['num_prompts']} ({w['mix']}, seed {w['seed']}); prompt tokens mean "
        f"{p['mean']:.0f} (min {p['min']}, max {p['max']}), output tokens mean {o['mean']:.0f} "
        f"(min {o['min']}, max {o['max']})",
    ]
    return "\n".join(lines) + "\n"


def print_report(result: dict[str, Any]) -> None:
    """Print the run: header, one line per rate, transformers, decode-only.

    :param result: :func:`run_throughput`'s result.
    """
    print(format_header(result))
    print_table(result["rates"])
    for r in result["rates"]:
        if not r["exact_lengths"]:
            print(f"rate {r['rate']}: some requests did not produce exactly their output length")
    hf = result["transformers"]
    print()
    if hf["status"] == "ok":
        ratio = hf.get("backplane_ratio")
        print(
            f"transformers generate, {hf['batch']} requests at once (padded to "
            f"{hf['padded_prompt_len']}): {hf['output_token_throughput']:.1f} output tok/s, "
            f"{hf['total_token_throughput']:.1f} total tok/s"
            + (f"; backplane at inf: {ratio:.2f}x" if ratio is not None else "")
        )
    else:
        print(f"transformers: {hf['status']} ({hf.get('reason')})")
    dec = result["decode"]
    if dec["batches"]:
        print(
            f"\ndecode-only: prompt {dec['prompt_len']} tokens, {dec['steps']} steps per sequence"
        )
        print(f"{'batch':>6} {'ms/step':>9} {'tok/s':>10} {'floor ms':>9} {'x floor':>8}")
        for row in dec["batches"]:
            if row["status"] != "ok":
                print(f"{row['batch']:>6} {row['status']}: {row.get('reason')}")
                continue
            floor = row.get("floor_ms_per_step")
            print(
                f"{row['batch']:>6} {row['ms_per_step']:>9.3f} {row['tokens_per_s']:>10.1f} "
                + (f"{floor:>9.3f} {row['x_floor']:>8.2f}" if floor is not None else "")
            )
        if dec["floor_skipped"]:
            print(f"floor: skipped ({dec['floor_skipped']})")
        elif dec["bandwidth"]:
            print(f"floor: read bandwidth {dec['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s")


def matplotlib_reason() -> str | None:
    """Why no plot can be drawn here (``None``: matplotlib imports)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"matplotlib is not installed ({exc}); pip install 'backplane[bench]'"
    return None


def write_plot(result: dict[str, Any], path: str) -> None:
    """Plot output tokens/s against request rate and against decode batch size.

    :param result: :func:`run_throughput`'s result.
    :param path: the PNG to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rates"]
    decode = [r for r in result["decode"]["batches"] if r["status"] == "ok"]
    panels = 1 + bool(decode)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax = axes[0][0]
    x = list(range(len(rows)))
    ax.plot(x, [r["output_token_throughput"] for r in rows], "o-", label="backplane")
    hf = result["transformers"]
    if hf["status"] == "ok":
        at = next((i for i, r in enumerate(rows) if r["rate"] == "inf"), len(rows) - 1)
        ax.plot([at], [hf["output_token_throughput"]], "s", label="transformers generate")
    ax.set_xticks(x, [str(r["rate"]) for r in rows])
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{result['workload']['num_prompts']} requests ({result['workload']['mix']})")
    ax.legend()
    ax.grid(alpha=0.3)
    if decode:
        ax = axes[0][1]
        bs = [r["batch"] for r in decode]
        ax.plot(bs, [r["tokens_per_s"] for r in decode], "o-", label="backplane")
        if all("floor_tokens_per_s" in r for r in decode):
            ax.plot(bs, [r["floor_tokens_per_s"] for r in decode], "k--", label="HBM floor")
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.set_xlabel("batch (sequences decoding)")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"decode only, {result['decode']['steps']} steps")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['model']['name']}, {result['engine']['config']['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
