"""Decode-only throughput: a batch of sequences decoding together, against the HBM floor."""

from __future__ import annotations

import logging
from typing import Any

from backplane.cli.bench.latency.engines import generate_backplane
from backplane.cli.bench.latency.floor import floor_bytes
from backplane.cli.bench.latency.measure import make_prompts, one_line
from backplane.cli.bench.latency.weights import WeightsInfo
from backplane.core.launch import cdiv

logger = logging.getLogger(__name__)


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
        need = cdiv(prompt_len + steps, engine.page_size) * engine.page_size * b
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
