"""Requests at a rate through :class:`~backplane.api.AsyncLLM`: the run's requests, sent and timed."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import statistics
import time
from typing import Any

from backplane.cli.bench.latency.measure import one_line
from backplane.cli.bench.workload import (
    RequestResult,
    RequestSpec,
    arrival_offsets,
    sharegpt_like_requests,
    summarize,
)
from backplane.core.errors import BackplaneError, ConfigError

logger = logging.getLogger(__name__)


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


def make_specs(args: argparse.Namespace, seed: int, vocab: int, max_len: int) -> list[RequestSpec]:
    """The requests of the run: the ShareGPT-like mix, with the lengths the flags fix.

    :param args: the parsed flags (``--num-prompts``, ``--input-len``, ``--output-len``,
        ``--max-input-len``, ``--max-output-len``).
    :param seed: the seed of the mix.
    :param vocab: prompt token ids are drawn from ``[0, vocab)``.
    :param max_len: the engine's ``max_model_len``.
    :return: the requests, in arrival order.
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


def lengths_summary(values: list[int]) -> dict[str, float]:
    """Mean, median, min and max of a list of lengths.

    :param values: the lengths (at least one).
    :return: ``mean``, ``median``, ``min`` and ``max``.
    """
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }
