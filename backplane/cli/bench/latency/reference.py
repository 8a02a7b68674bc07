"""The transformers side of a latency run: the same weights through ``generate``.

Eager with its default dynamic cache, and a static cache with the decode step
compiled (``torch.compile``, ``mode="reduce-overhead"``, through
``generate``'s ``compile_config``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

from backplane.cli.bench.latency.measure import (
    Generation,
    failed_row,
    free_device_memory,
    one_line,
    settle_status,
    skipped,
    sync,
    timed_runs,
    timing_row,
)
from backplane.cli.bench.latency.settings import TRANSFORMERS_MODES, Settings

logger = logging.getLogger(__name__)


class _TokenClock:
    """A ``generate`` streamer that notes when each batch of tokens reaches the host.

    ``generate`` hands the prompt first, then each step's tokens after copying
    them to the host (a synchronisation), so the times are the device's.
    """

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        """Note the time (the first call carries the prompt)."""
        self.times.append(time.perf_counter())

    def end(self) -> None:
        """Nothing to flush."""


@contextlib.contextmanager
def _transformers_notes(notes: list[str]) -> Iterator[None]:
    """Collect transformers' warnings that explain its speed (e.g. a kernel fallback)."""

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if "falling back" in msg or "fallback" in msg or "compil" in msg.lower():
                line = msg.splitlines()[0].split(". ")[0] if msg else msg
                if line not in notes:
                    notes.append(line)

    handler = _Collect(level=logging.WARNING)
    log = logging.getLogger("transformers")
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)


def generate_transformers(
    model: Any,
    input_ids: Any,
    new_tokens: int,
    extra: dict[str, Any],
    attention_mask: Any = None,
) -> Generation:
    """One timed ``generate``: ``(ttft s, s per token after the first, new tokens)``.

    :param model: the transformers model.
    :param input_ids: the batch's prompts, one tensor.
    :param new_tokens: tokens each request generates (no fewer, no more).
    :param extra: more ``generate`` arguments (the static cache and compile config).
    :param attention_mask: ``0`` over padding (prompts of several lengths, padded
        on the left); ``None``: every prompt fills its row.
    :return: the times from the streamer, and the new tokens per request.
    """
    import torch

    clock = _TokenClock()
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    sync(input_ids.device)
    t0 = time.perf_counter()
    # as users call it (generate runs without autograd by itself)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids) if attention_mask is None else attention_mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad,
        streamer=clock,
        **extra,
    )
    sync(input_ids.device)
    t_end = time.perf_counter()
    times = clock.times[1:] or [t_end]  # times[0]: the prompt
    per_token = (times[-1] - times[0]) / max(new_tokens - 1, 1)
    tokens = out[:, input_ids.shape[1] :].tolist()
    return times[0] - t0, per_token, tokens


def load_transformers_model(folder: str, device: Any, dtype: Any) -> Any:
    """Load a saved HF folder with ``transformers``, on ``device``, for inference.

    :param folder: the folder (``config.json`` + safetensors).
    :param device: the ``torch.device``.
    :param dtype: the ``torch.dtype`` of the weights.
    :return: the model, in eval mode.
    :raises ImportError: transformers is not installed.
    """
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.to(device).eval()


def _dynamo_graphs() -> int:
    """Graphs compiled by dynamo so far (``-1`` when the counter is not available)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:
        return -1


def _compile_config(transformers: Any, device: Any, *, fullgraph: bool) -> Any:
    """The ``compile_config`` that makes ``generate`` compile its decode step.

    :param transformers: the ``transformers`` module.
    :param device: the ``torch.device``; off CUDA, ``generate`` compiles only
        when told to compile on every device.
    :param fullgraph: refuse graph breaks.
    :return: a ``transformers.CompileConfig`` with ``mode="reduce-overhead"``.
    """
    config = transformers.CompileConfig(fullgraph=fullgraph, mode="reduce-overhead")
    if device.type != "cuda":
        config._compile_all_devices = True
    return config


def run_transformers(
    folder: str,
    settings: Settings,
    *,
    prompts: dict[int, list[list[int]]],
    device: Any,
    dtype: Any,
    tokens_out: dict[tuple[str, int], list[list[int]]],
) -> dict[str, dict[str, Any]]:
    """Measure ``transformers`` on the saved weights: eager and/or static cache + compile.

    Eager uses ``generate``'s default (dynamic) cache. ``compile`` passes
    ``cache_implementation="static"`` and a ``CompileConfig(fullgraph=True,
    mode="reduce-overhead")``, with which ``generate`` compiles the decode step
    (prefill stays eager), warmed up twice per batch size (compilation, then
    graph recording); when the full graph cannot be captured it retries with
    graph breaks allowed and says so. On a CPU the compiled mode is skipped
    unless ``settings.compile_on_cpu``.

    :param folder: the saved HF folder.
    :param settings: the run's settings.
    :param prompts: ``{batch: prompts}``.
    :param device: the ``torch.device``.
    :param dtype: the ``torch.dtype`` to load the weights in.
    :param tokens_out: filled with the first timed run's tokens per ``(mode, batch)``.
    :return: ``{mode: entry}`` for each requested mode.
    """
    import torch

    entries: dict[str, dict[str, Any]] = {}
    modes = [m for m in TRANSFORMERS_MODES if m in settings.transformers_modes]
    if not modes:
        return entries
    try:
        import transformers
    except ImportError as exc:
        for mode in modes:
            entries[mode] = skipped(
                f"transformers is not installed ({exc}); pip install transformers"
            )
        return entries
    notes: list[str] = []
    try:
        with _transformers_notes(notes):
            model = load_transformers_model(folder, device, dtype)
    except Exception as exc:
        logger.debug("transformers failed to load %s", folder, exc_info=True)
        for mode in modes:
            entries[mode] = skipped(f"transformers cannot load the model: {one_line(exc)}")
        return entries
    attn_impl = getattr(model.config, "_attn_implementation", None)
    n = settings.new_tokens
    try:
        for mode in modes:
            entry: dict[str, Any] = {"attn_implementation": attn_impl, "batches": []}
            extra: dict[str, Any] = {}
            warmup = settings.warmup
            if mode == "compile":
                if device.type != "cuda" and not settings.compile_on_cpu:
                    entries[mode] = skipped(
                        "transformers compiles the decode step on CUDA only; "
                        "pass --compile-on-cpu to force it here"
                    )
                    continue
                try:
                    config = _compile_config(transformers, device, fullgraph=True)
                except Exception as exc:
                    entries[mode] = skipped(f"no transformers.CompileConfig: {one_line(exc)}")
                    continue
                extra = {"cache_implementation": "static", "compile_config": config}
                entry["compile_config"] = {"fullgraph": True, "mode": "reduce-overhead"}
                warmup = max(warmup, 2)  # the first compiles, the second records graphs
            graphs_before = _dynamo_graphs()
            recompiled = False  # a reset makes the graph counter useless as a check
            for batch in settings.batch_sizes:
                input_ids = torch.tensor(prompts[batch], dtype=torch.long, device=device)
                try:
                    with _transformers_notes(notes):
                        try:
                            for _ in range(warmup):
                                generate_transformers(model, input_ids, n, extra)
                        except Exception as exc:
                            if mode != "compile" or not extra["compile_config"].fullgraph:
                                raise
                            logger.info(
                                "full-graph compile failed (%s); retrying with graph breaks",
                                one_line(exc),
                            )
                            torch.compiler.reset()
                            recompiled = True
                            extra["compile_config"] = _compile_config(
                                transformers, device, fullgraph=False
                            )
                            entry["compile_config"]["fullgraph"] = False
                            entry.setdefault("notes", []).append(
                                f"fullgraph=True failed: {one_line(exc)}"
                            )
                            for _ in range(warmup):
                                generate_transformers(model, input_ids, n, extra)
                        runs, tokens = timed_runs(
                            partial(generate_transformers, model, input_ids, n, extra),
                            settings.repeats,
                        )
                    tokens_out[(mode, batch)] = tokens
                    entry["batches"].append(timing_row(batch, runs, tokens, n))
                except Exception as exc:
                    logger.debug("transformers %s batch %d failed", mode, batch, exc_info=True)
                    entry["batches"].append(failed_row(batch, exc))
                finally:
                    del input_ids
            uncompiled = graphs_before >= 0 and _dynamo_graphs() == graphs_before
            if mode == "compile" and not recompiled and uncompiled:
                for row in entry["batches"]:
                    if row["status"] == "ok":
                        row["status"] = "failed"
                        row["reason"] = "transformers ran the decode step without compiling it"
            settle_status(entry)
            entries[mode] = entry
    finally:
        del model
        with contextlib.suppress(Exception):
            torch.compiler.reset()
        free_device_memory(device)
    for entry in entries.values():
        if notes and entry.get("status") != "skipped":
            entry.setdefault("notes", []).extend(notes)
    return entries
