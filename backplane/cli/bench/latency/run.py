"""One latency run: every shape, configuration and batch size, in this process.

Per shape: save the random weights, compute the memory floor, measure each
backplane configuration (engines built one after another and freed in
between), then transformers, and compare every side's tokens with
transformers eager.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import asdict
from typing import Any

from backplane.cli.bench.anchors import latency_comparisons
from backplane.cli.bench.latency.checkpoint import checkpoint_file, checkpoint_tokenizer
from backplane.cli.bench.latency.engines import run_backplane
from backplane.cli.bench.latency.floor import floor_bytes, measure_bandwidth
from backplane.cli.bench.latency.measure import (
    agreement,
    free_device_memory,
    make_prompts,
    one_line,
    settle_status,
    skipped,
)
from backplane.cli.bench.latency.quantized import held_weights_info, is_held_quantized
from backplane.cli.bench.latency.random_gguf import random_gguf_path, write_random_gguf
from backplane.cli.bench.latency.reference import run_transformers
from backplane.cli.bench.latency.report import si
from backplane.cli.bench.latency.settings import Settings, check_settings, resolve_device_dtype
from backplane.cli.bench.latency.shapes import is_model_dir, shape_config
from backplane.cli.bench.latency.shard import rank_weights_info
from backplane.cli.bench.latency.speculation import (
    chat_rewrite_prompt,
    compare_with_baseline,
    rewrite_prompts,
    speculation_label,
)
from backplane.cli.bench.latency.weights import (
    folder_weights_info,
    gguf_weights_info,
    save_random_weights,
    weights_workdir,
)
from backplane.cli.bench.machine import machine_info
from backplane.core.errors import BackendUnavailableError, ConfigError, UnknownBackendError

logger = logging.getLogger(__name__)


def _label(kind: str, **kw: str) -> str:
    """A configuration's name in tables, plots and agreement references.

    :param kind: ``backplane`` (with ``attention`` and ``graphs``) or
        ``transformers`` (with ``mode``).
    :return: e.g. ``"backplane triton, graphs"`` or ``"transformers eager"``.
    """
    if kind == "backplane":
        graphs = "graphs" if kw["graphs"] == "on" else "eager"
        return f"backplane {kw['attention']}, {graphs}"
    return "transformers static+compile" if kw["mode"] == "compile" else "transformers eager"


def _storage_label(settings: Settings) -> str:
    """How the engines hold the weights and KV cache, for labels (empty: as saved, in the dtype).

    :param settings: the run's settings.
    :return: e.g. ``"fp8 weights, fp8 KV"``, ``"gguf-q4_k weights"`` or ``""``.
    """
    parts = []
    if settings.quantization is not None:
        parts.append(f"{settings.quantization} weights")
    if settings.weights_format != "safetensors":
        parts.append(f"{settings.weights_format} weights")
    if settings.kv_cache_dtype != "auto":
        parts.append(f"{settings.kv_cache_dtype} KV")
    return ", ".join(parts)


def _floor_rows(info: Any, settings: Settings, bandwidth: float) -> list[dict[str, Any]]:
    """The floor's row per batch size: its bytes per step and their time at ``bandwidth``.

    :param info: the sizes (a :class:`~backplane.cli.bench.latency.weights.WeightsInfo`).
    :param settings: the run's settings.
    :param bandwidth: the read bandwidth, bytes per second.
    :return: ``{"batch", "status", "ms_per_token", "bytes_per_step"}`` per batch size.
    """
    rows = []
    for b in settings.batch_sizes:
        parts = floor_bytes(info, b, settings.prompt_len, settings.new_tokens)
        rows.append(
            {
                "batch": b,
                "status": "ok",
                "ms_per_token": parts["total"] / bandwidth * 1e3,
                "bytes_per_step": parts,
            }
        )
    return rows


def _advance(progress: Any, n: int, what: str) -> None:
    """Move the progress bar (if any) by ``n`` runs and say what was done."""
    if progress is not None:
        progress.set_postfix_str(what, refresh=False)
        progress.update(n)


def run_shape(
    name: str,
    settings: Settings,
    *,
    device: Any,
    dtype: Any,
    dtype_name: str,
    bandwidth: float,
    workdir: str,
    progress: Any = None,
) -> dict[str, Any]:
    """Measure every configuration of one shape.

    :param name: the shape's name.
    :param settings: the run's settings.
    :param device: the ``torch.device``.
    :param dtype: the ``torch.dtype``.
    :param dtype_name: its name.
    :param bandwidth: the measured read bandwidth, bytes per second.
    :param workdir: where the weights are saved.
    :param progress: a ``tqdm`` bar advanced by each configuration, or ``None``.
    :return: the shape's results: its config and sizes, and one entry per
        configuration (floor first) with a row per batch size.
    """
    config = shape_config(name)
    t0 = time.perf_counter()
    gguf = checkpoint_file(name)
    trained = gguf is not None or is_model_dir(name)
    if gguf is not None:
        # a GGUF checkpoint is measured as it is, as a model directory is
        info = gguf_weights_info(gguf, dtype)
        what = "sized"
    elif settings.weights_format != "safetensors":
        gguf = random_gguf_path(workdir, name)
        logger.info("%s: random %s weights in %s", name, settings.weights_format, gguf)
        write_random_gguf(name, config, gguf)
        # sized from its tensor table, as a GGUF checkpoint is
        info = gguf_weights_info(gguf, dtype)
        what = "written"
    elif not is_model_dir(name):
        folder = os.path.join(workdir, f"{name}-{dtype_name}")
        logger.info("%s: building random %s weights in %s", name, dtype_name, folder)
        info = save_random_weights(name, config, folder, dtype)
        what = "saved"
    else:
        # a model directory is measured as it is: its own weights, its sizes from the headers
        info = folder_weights_info(name, dtype)
        what = "sized"
    logger.info(
        "%s: %s parameters, %s, %s in %.1fs",
        name,
        si(info.params, ""),
        si(info.weight_bytes, "B"),
        what,
        time.perf_counter() - t0,
    )
    vocab = int(config["vocab_size"])
    chat_prompt = None
    if settings.workload == "rewrite" and trained:
        chat_prompt = chat_rewrite_prompt(checkpoint_tokenizer(info.folder))
    if chat_prompt is not None:
        # a trained model rewrites a real text: the prompt's length is the run's prompt length
        settings = dataclasses.replace(settings, prompt_len=len(chat_prompt))
        limit = int(config.get("max_position_embeddings", 4096))
        if settings.prompt_len + settings.new_tokens > limit:
            raise ConfigError(
                f"shape {name!r} holds {limit} positions, fewer than the rewrite prompt's "
                f"{settings.prompt_len} tokens + --new-tokens {settings.new_tokens}; "
                "give fewer --new-tokens"
            )
        logger.info("%s: rewrite prompt of %d tokens", name, settings.prompt_len)
        prompts = {b: [list(chat_prompt) for _ in range(b)] for b in settings.batch_sizes}
    else:
        prompter = rewrite_prompts if settings.workload == "rewrite" else make_prompts
        prompts = {
            b: prompter(settings.seed, b, settings.prompt_len, vocab) for b in settings.batch_sizes
        }
    floor_label = "HBM floor" if device.type == "cuda" else "memory floor"
    held = is_held_quantized(settings.quantization, settings.kv_cache_dtype)
    stored = info
    # the engine's quantised weights and KV cache, counted as the engine holds them
    info = held_weights_info(
        info, dtype, quantization=settings.quantization, kv_cache_dtype=settings.kv_cache_dtype
    )
    floor_info, stored_floor_info = info, stored
    if settings.tensor_parallel_size > 1:
        # the ranks read their shards at once: the floor is one rank's bytes
        stored_floor_info = rank_weights_info(stored, dtype, settings.tensor_parallel_size)
        floor_info = stored_floor_info
        if settings.quantization is not None:
            floor_info = rank_weights_info(
                info, dtype, settings.tensor_parallel_size, settings.quantization
            )
        if held and stored.kv_bytes_per_token:
            floor_info = dataclasses.replace(
                floor_info,
                kv_bytes_per_token=stored_floor_info.kv_bytes_per_token
                * info.kv_bytes_per_token
                / stored.kv_bytes_per_token,
            )
        floor_label += f" per rank, tp={settings.tensor_parallel_size}"
    storage = _storage_label(settings)
    floor_rows = _floor_rows(floor_info, settings, bandwidth)
    configs: list[dict[str, Any]] = [
        {
            "label": f"{floor_label}, {storage}" if storage else floor_label,
            "kind": "floor",
            "status": "ok",
            "batches": floor_rows,
        }
    ]
    if held:
        # the floor of the same shape held in the run's dtype, for comparison
        kept = "weights and KV" if settings.weights_format == "safetensors" else "KV"
        configs.append(
            {
                "label": f"{floor_label}, {dtype_name} {kept}",
                "kind": "floor",
                "status": "ok",
                "unquantized": True,
                "batches": _floor_rows(stored_floor_info, settings, bandwidth),
            }
        )
    tokens: dict[tuple[str, int], list[list[int]]] = {}

    unavailable: dict[str, str] = {}
    # with speculation each configuration runs twice, without first: the rows compared
    variants: list[dict[str, Any] | None] = [None]
    if settings.speculative_config is not None:
        variants.append(settings.speculative_config)
    allocated_before = 0
    if device.type == "cuda":
        import torch

        allocated_before = torch.cuda.memory_allocated(device)
    for attention in settings.attention_backends:
        for graphs in settings.cuda_graphs:
            baseline: dict[str, Any] | None = None
            for spec in variants:
                label = _label("backplane", attention=attention, graphs=graphs)
                if settings.tensor_parallel_size > 1:
                    label += f", tp={settings.tensor_parallel_size}"
                    if settings.custom_all_reduce is False:
                        label += ", NCCL all-reduce"
                if spec is not None:
                    label += f", {speculation_label(spec)}"
                entry: dict[str, Any] = {
                    "label": label,
                    "kind": "backplane",
                    "attention": attention,
                    "cuda_graphs": graphs,
                }
                if spec is not None:
                    entry["speculative_config"] = dict(spec)
                why = unavailable.get(attention)
                if why is None and graphs == "on" and device.type != "cuda":
                    why = f"CUDA graphs need a CUDA device (this run is on {device.type})"
                if why is not None:
                    entry.update(skipped(why))
                    configs.append(entry)
                    _advance(progress, len(settings.batch_sizes), f"{name}: {label} skipped")
                    continue
                logger.info("%s: %s", name, label)
                per_batch: dict[int, list[list[int]]] = {}
                try:
                    entry.update(
                        run_backplane(
                            info.folder,
                            settings,
                            attention=attention,
                            graphs=graphs,
                            prompts=prompts,
                            device=device,
                            dtype_name=dtype_name,
                            tokens_out=per_batch,
                            speculative_config=spec,
                        )
                    )
                    settle_status(entry)
                except (BackendUnavailableError, UnknownBackendError) as exc:
                    # the engine checks its backends before reading any weight
                    unavailable[attention] = str(exc)
                    entry.update(skipped(str(exc)))
                    free_device_memory(device)
                except Exception as exc:
                    logger.debug("%s: %s failed", name, label, exc_info=True)
                    entry.update({"status": "failed", "reason": one_line(exc), "batches": []})
                    free_device_memory(device)
                if device.type == "cuda":
                    import torch

                    left = torch.cuda.memory_allocated(device) - allocated_before
                    entry["allocated_after_free_mib"] = left / 2**20
                    if left > 256 << 20:
                        logger.warning(
                            "%s: %.0f MiB still allocated after freeing the engine of %s; "
                            "later engines have less memory",
                            name,
                            left / 2**20,
                            label,
                        )
                for b, toks in per_batch.items():
                    tokens[(label, b)] = toks
                if spec is None:
                    baseline = entry
                elif baseline is not None:
                    compare_with_baseline(entry, baseline, floor_rows)
                configs.append(entry)
                _advance(progress, len(settings.batch_sizes), f"{name}: {label}")

    hf_tokens: dict[tuple[str, int], list[list[int]]] = {}
    why = None
    if gguf is not None:
        why = (
            "transformers runs on a Hugging Face folder, not a GGUF file; "
            "pass --transformers none to leave it out"
        )
    elif settings.quantization is not None:
        why = (
            f"transformers would run the {dtype_name} weights, not {settings.quantization}; "
            "pass --transformers none to leave it out"
        )
    if settings.transformers_modes and why is not None:
        for mode in settings.transformers_modes:
            label = _label("transformers", mode=mode)
            configs.append({"label": label, "kind": "transformers", "mode": mode, **skipped(why)})
            _advance(progress, len(settings.batch_sizes), f"{name}: {label} skipped")
    elif settings.transformers_modes:
        logger.info("%s: transformers %s", name, ",".join(settings.transformers_modes))
        hf = run_transformers(
            info.folder,
            settings,
            prompts=prompts,
            device=device,
            dtype=dtype,
            tokens_out=hf_tokens,
        )
        for mode, entry in hf.items():
            label = _label("transformers", mode=mode)
            configs.append({"label": label, "kind": "transformers", "mode": mode, **entry})
            for (m, b), toks in hf_tokens.items():
                if m == mode:
                    tokens[(label, b)] = toks
            _advance(progress, len(settings.batch_sizes), f"{name}: {label}")

    reference = "transformers eager"
    for entry in configs:
        if entry["kind"] == "floor" or entry["label"] == reference:
            continue
        for row in entry.get("batches", []):
            ref = tokens.get((reference, row["batch"]))
            mine = tokens.get((entry["label"], row["batch"]))
            if ref is not None and mine is not None:
                row["agreement"] = {"reference": reference, **agreement(mine, ref)}

    return {
        "name": name,
        "config": config,
        "architecture": (config.get("architectures") or ["?"])[0],
        "params": info.params,
        "weight_bytes": info.weight_bytes,
        "stored_weight_bytes": stored.weight_bytes,
        "kv_bytes_per_token": info.kv_bytes_per_token,
        "state_bytes_per_seq": info.state_bytes_per_seq,
        "run": {
            "batch_sizes": list(settings.batch_sizes),
            "prompt_len": settings.prompt_len,
            "new_tokens": settings.new_tokens,
            "dtype": dtype_name,
            "repeats": settings.repeats,
            "workload": settings.workload,
            "speculative_config": settings.speculative_config,
            "quantization": settings.quantization,
            "kv_cache_dtype": settings.kv_cache_dtype,
            "weights_format": settings.weights_format,
        },
        "configs": configs,
    }


def run_benchmark(settings: Settings) -> dict[str, Any]:
    """Run every shape, configuration and batch size of ``settings`` in this process.

    :param settings: what to measure (its batch sizes are sorted and deduplicated in place).
    :return: the JSON-serialisable result: ``machine``, ``settings``,
        ``bandwidth`` and one entry per shape (see :func:`run_shape`).
    :raises ConfigError: invalid settings (nothing is run).
    """
    from tqdm.auto import tqdm

    check_settings(settings)
    settings.batch_sizes = sorted(set(settings.batch_sizes))
    device, dtype, dtype_name = resolve_device_dtype(settings)
    machine = machine_info(device)
    bandwidth = measure_bandwidth(device)
    logger.info(
        "read bandwidth %.1f GB/s (%s)", bandwidth["bytes_per_s"] / 1e9, bandwidth["method"]
    )
    variants = 1 if settings.speculative_config is None else 2
    per_shape = variants * len(settings.attention_backends) * len(settings.cuda_graphs) + len(
        settings.transformers_modes
    )
    total = len(settings.shapes) * per_shape * len(settings.batch_sizes)
    shapes = []
    with contextlib.ExitStack() as stack:
        workdir = weights_workdir(stack, settings.weights_dir, "bench-latency-")
        progress = stack.enter_context(
            tqdm(total=total, desc="bench latency", unit="run", disable=None)
        )
        for name in settings.shapes:
            shapes.append(
                run_shape(
                    name,
                    settings,
                    device=device,
                    dtype=dtype,
                    dtype_name=dtype_name,
                    bandwidth=bandwidth["bytes_per_s"],
                    workdir=workdir,
                    progress=progress,
                )
            )
    for shape in shapes:
        # the published figures are of bfloat16 weights and caches
        plain = _storage_label(settings) == ""
        shape["anchors"] = latency_comparisons(shape, machine.get("gpu")) if plain else []
    data = asdict(settings)
    data["dtype_resolved"] = dtype_name
    return {"machine": machine, "settings": data, "bandwidth": bandwidth, "shapes": shapes}
