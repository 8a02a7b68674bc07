"""The backplane side of a latency run: one engine per configuration, timed through ``LLM.generate``."""

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
    sync,
    timed_runs,
    timing_row,
)
from backplane.cli.bench.latency.settings import PAGE_SIZE, Settings
from backplane.cli.bench.latency.speculation import acceptance_figures, speculation_counts
from backplane.engine.sizes import pages_per_seq as seq_pages

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def quiet_missing_tokenizer() -> Iterator[None]:
    """The benchmark's folders carry no tokenizer on purpose (no detokenizing in the loop)."""
    # the loader and the tokenizer module have both reported it
    logs = [logging.getLogger(f"backplane.models.{m}") for m in ("loader", "tokenizer")]

    def drop(record: logging.LogRecord) -> bool:
        return "tokenizer.json" not in record.getMessage()

    for log in logs:
        log.addFilter(drop)
    try:
        yield
    finally:
        for log in logs:
            log.removeFilter(drop)


def generate_backplane(
    llm: Any,
    prompts: list[list[int]],
    new_tokens: int,
    counts_out: list[dict[str, int]] | None = None,
) -> Generation:
    """One timed ``LLM.generate``: ``(ttft s, s per token after the first, tokens)``.

    The time per token is the decode phase's wall time over the tokens it
    generated, so with speculative decoding it is the effective time per token.

    :param llm: the engine's ``LLM``.
    :param prompts: the batch's prompts.
    :param new_tokens: tokens each request generates (end of sequence ignored).
    :param counts_out: when given, the batch's speculative-decoding counts are
        appended to it (see :func:`~backplane.cli.bench.latency.speculation.speculation_counts`).
    :return: the times from the requests' own metrics, and their tokens.
    """
    from backplane import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    device = llm.engine.device
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    t_end = time.perf_counter()
    firsts, lasts = [], []
    for out in outs:
        m = out.metrics
        if m is None or m.time_to_first_token is None:
            firsts.append(t_end)
            lasts.append(t_end)
            continue
        first = m.arrival_time + m.time_to_first_token
        firsts.append(first)
        lasts.append(first + sum(m.inter_token_latencies))
    if counts_out is not None:
        counts_out.append(speculation_counts(outs))
    first, last = max(firsts), max(lasts)
    per_token = (last - first) / max(new_tokens - 1, 1)
    return first - t0, per_token, [list(o.token_ids) for o in outs]


def run_backplane(
    folder: str,
    settings: Settings,
    *,
    attention: str,
    graphs: str,
    prompts: dict[int, list[list[int]]],
    device: Any,
    dtype_name: str,
    tokens_out: dict[int, list[list[int]]],
    speculative_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Measure one backplane configuration at every batch size with one engine.

    The engine is sized for the largest batch: ``max_num_seqs`` = that batch,
    a token budget that takes all its prompts in one step, ``max_model_len`` =
    prompt + new tokens, and exactly enough KV pages (plus a margin) so that
    engines built one after another fit; prefix caching is off so repeated
    prompts are recomputed. The settings' quantization and KV-cache dtype are
    passed on when they are not the defaults.

    :param folder: the saved HF folder or GGUF file.
    :param settings: the run's settings.
    :param attention: the attention backend.
    :param graphs: ``on`` (the default CUDA-graph mode) or ``off``.
    :param prompts: ``{batch: prompts}``.
    :param device: the ``torch.device``.
    :param dtype_name: the dtype's name.
    :param tokens_out: filled with the first timed run's tokens per batch.
    :param speculative_config: the engine's speculative decoding, or ``None``;
        with it each row also carries ``speculation``: the first timed run's
        verifying steps, draft and accepted tokens (over the batch), acceptance
        rate and mean accepted length.
    :return: the configuration's entry (``status``, ``backends``, ``batches``).
    """
    from backplane import LLM

    p, n = settings.prompt_len, settings.new_tokens
    max_batch = max(settings.batch_sizes)
    pages_per_seq = seq_pages(p + n, PAGE_SIZE)
    overrides = {
        "device": str(device),
        "dtype": dtype_name,
        "max_num_seqs": max_batch,
        "max_num_tokens": max(max_batch * p, max_batch),
        "max_model_len": p + n,
        "page_size": PAGE_SIZE,
        "num_kv_pages": max_batch * (pages_per_seq + 1) + 2,
        "enable_prefix_caching": False,
        "cuda_graphs": None if graphs == "on" else "off",
        "seed": settings.seed,
        "backends": {**settings.backends, "attention": attention},
        "tensor_parallel_size": settings.tensor_parallel_size,
    }
    if settings.custom_all_reduce is not None:
        overrides["custom_all_reduce"] = settings.custom_all_reduce
    if speculative_config is not None:
        overrides["speculative_config"] = dict(speculative_config)
    if settings.quantization is not None:
        overrides["quantization"] = settings.quantization
    if settings.kv_cache_dtype != "auto":
        overrides["kv_cache_dtype"] = settings.kv_cache_dtype
    entry: dict[str, Any] = {"engine_settings": dict(overrides), "batches": []}
    t0 = time.perf_counter()
    with quiet_missing_tokenizer():
        llm = LLM(folder, **overrides)
    entry["startup_s"] = time.perf_counter() - t0
    entry["backends"] = {
        f: getattr(b, "name", type(b).__name__) for f, b in llm.engine.backends.items()
    }
    try:
        for batch in settings.batch_sizes:
            try:
                for _ in range(settings.warmup):
                    generate_backplane(llm, prompts[batch], n)
                counts: list[dict[str, int]] = []
                # a temporary: a name bound to it would keep the engine alive past `del llm`
                runs, tokens = timed_runs(
                    partial(generate_backplane, llm, prompts[batch], n, counts), settings.repeats
                )
                tokens_out[batch] = tokens
                row = timing_row(batch, runs, tokens, n)
                if speculative_config is not None:
                    # the first run's counts: the run whose tokens are kept
                    row["speculation"] = {**counts[0], **acceptance_figures(counts[0])}
                entry["batches"].append(row)
            except Exception as exc:  # one batch size failing (memory...) keeps the others
                logger.debug("backplane %s batch %d failed", attention, batch, exc_info=True)
                entry["batches"].append(failed_row(batch, exc))
    finally:
        llm.shutdown()
        del llm
        free_device_memory(device)
    return entry
