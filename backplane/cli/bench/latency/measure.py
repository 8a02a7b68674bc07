"""What the backplane and the transformers measurements share.

Device synchronisation and clean-up between engines, the prompts both sides
decode, the timed-run loop and its summary row, the entries of skipped or
failed configurations, and how far two sides' tokens agree.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from typing import Any

Generation = tuple[float, float, list[list[int]]]
"""One timed generation: ``(ttft s, s per token after the first, tokens per request)``."""


def sync(device: Any) -> None:
    """Wait for the device's queued work, so that a wall clock read afterwards is fair.

    :param device: a ``torch.device`` (nothing to wait for on a CPU).
    """
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: Any) -> None:
    """Give the memory of a freed engine or model back, for the next one built.

    :param device: a ``torch.device``.
    """
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def make_prompts(seed: int, batch: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    """Random prompts, the same for every configuration of one batch size.

    :param seed: the run's seed.
    :param batch: the batch size (part of the seed).
    :param prompt_len: tokens per prompt.
    :param vocab_size: the shape's vocabulary.
    :return: ``batch`` lists of ``prompt_len`` token ids below ``vocab_size``.
    """
    import numpy as np

    rng = np.random.default_rng([seed, batch])
    return rng.integers(0, vocab_size, size=(batch, prompt_len)).tolist()


def timed_runs(
    generate: Callable[[], Generation], repeats: int
) -> tuple[list[tuple[float, float]], list[list[int]]]:
    """Time ``repeats`` generations of one configuration and batch size.

    :param generate: one timed generation (warmed up already).
    :param repeats: how many (at least 1).
    :return: each run's ``(ttft s, s per token)`` and the first run's tokens.
    """
    runs: list[tuple[float, float]] = []
    tokens: list[list[int]] = []
    for r in range(repeats):
        ttft, per_token, toks = generate()
        runs.append((ttft, per_token))
        if r == 0:
            tokens = toks
    return runs, tokens


def timing_row(
    batch: int,
    runs: list[tuple[float, float]],
    tokens: list[list[int]],
    new_tokens: int,
) -> dict[str, Any]:
    """Summarise timed runs: each is ``(ttft seconds, seconds per token)``.

    :param batch: the batch size.
    :param runs: the timed runs.
    :param tokens: the tokens of one run, per request.
    :param new_tokens: the tokens each request had to produce.
    :return: the batch's row: medians in ms, every run, and ``failed`` when a
        request produced another number of tokens (its time is not comparable).
    """
    ms = [r[1] * 1e3 for r in runs]
    ttft = [r[0] * 1e3 for r in runs]
    counts = [len(t) for t in tokens]
    row: dict[str, Any] = {
        "batch": batch,
        "status": "ok",
        "ms_per_token": statistics.median(ms),
        "ttft_ms": statistics.median(ttft),
        "runs_ms_per_token": ms,
        "runs_ttft_ms": ttft,
        "tokens_per_request": counts,
    }
    if any(c != new_tokens for c in counts):
        row["status"] = "failed"
        row["reason"] = f"produced {counts} tokens per request instead of {new_tokens} each"
    return row


def failed_row(batch: int, exc: BaseException) -> dict[str, Any]:
    """The row of a batch size that raised (the configuration's other sizes still run).

    :param batch: the batch size.
    :param exc: what it raised.
    :return: the row, with the error as its reason.
    """
    return {"batch": batch, "status": "failed", "reason": one_line(exc)}


def settle_status(entry: dict[str, Any]) -> None:
    """Set a configuration's ``status`` from its rows: ``ok`` if any batch size is.

    :param entry: the configuration's entry, with its ``batches``; when none is
        ``ok`` it also gets the first row's reason (else ``"failed"``).
    """
    ok = any(b["status"] == "ok" for b in entry["batches"])
    entry["status"] = "ok" if ok else "failed"
    if not ok:
        entry["reason"] = next((b["reason"] for b in entry["batches"] if b.get("reason")), "failed")


def skipped(reason: str) -> dict[str, Any]:
    """The entry of a configuration that is not measured here.

    :param reason: why (the report prints it).
    :return: ``status``, ``reason`` and no rows.
    """
    return {"status": "skipped", "reason": reason, "batches": []}


def one_line(exc: BaseException) -> str:
    """An exception as one line for a table: its type and its message's first line.

    :param exc: the exception.
    :return: ``"Type: first line"`` (``"Type"`` without a message).
    """
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """How far each request's tokens match the reference's (greedy decoding, same weights).

    :param tokens: one configuration's tokens per request.
    :param reference: the reference's tokens for the same prompts.
    :return: counts of identical requests and equal first tokens, the request
        count and the mean length of the common prefix.
    """
    prefixes = []
    for a, b in zip(tokens, reference, strict=False):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefixes.append(k)
    return {
        "identical_requests": sum(1 for a, b in zip(tokens, reference, strict=False) if a == b),
        "first_token_equal": sum(
            1 for a, b in zip(tokens, reference, strict=False) if a[:1] == b[:1]
        ),
        "requests": len(reference),
        "mean_common_prefix": statistics.fmean(prefixes) if prefixes else 0.0,
    }
