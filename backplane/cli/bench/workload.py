"""The synthetic request workloads of the serving benchmarks, and their statistics.

``backplane bench serve`` (over HTTP) and ``backplane bench throughput`` (in
one process) send the same kinds of requests and summarise them the same way:

* :func:`make_requests`: lengths uniform around a mean (``range_ratio = 0``
  gives fixed lengths);
* :func:`sharegpt_like_requests`: a seeded synthetic mix whose prompt and
  output lengths follow log-normal laws shaped like ShareGPT conversations
  (many short prompts, a long tail; outputs of a few hundred tokens), clipped
  the way vLLM filters that data set (4 tokens at least, prompts up to 1024,
  prompt + output up to 2048);
* :func:`arrival_offsets`: Poisson arrivals at a rate (``inf``: all at once);
* :func:`summarize`: TTFT, inter-token and end-to-end latency at p50 and p99
  and the throughputs of one run of requests (:class:`RequestResult`), and
  :func:`print_table` to show them, one line per rate.

Prompts are random token ids: the benchmarks measure the engine, not a
tokenizer, and output lengths are exact (``ignore_eos``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backplane.core.errors import ConfigError

__all__ = [
    "SHAREGPT_INPUT",
    "SHAREGPT_OUTPUT",
    "RequestResult",
    "RequestSpec",
    "arrival_offsets",
    "make_requests",
    "parse_rates",
    "percentile_ms",
    "print_table",
    "sharegpt_like_requests",
    "summarize",
]


@dataclass(frozen=True)
class RequestSpec:
    """One synthetic request: its prompt token ids and exact output length."""

    prompt_token_ids: list[int]
    output_len: int


@dataclass
class RequestResult:
    """What one request measured (seconds from its send).

    :param ok: whether it completed.
    :param ttft: time to its first token.
    :param itls: gaps between its consecutive tokens (or streamed chunks).
    :param e2e: time to its last token.
    :param output_tokens: tokens it produced.
    :param error: why it failed.
    :param prompt_tokens: tokens of its prompt.
    """

    ok: bool
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    error: str | None = None
    prompt_tokens: int = 0


def _token_ids(
    rng: np.random.Generator, lengths: np.ndarray, token_id_range: tuple[int, int]
) -> list[list[int]]:
    """Random prompt token ids in ``[lo, hi)``, one list per length."""
    lo, hi = token_id_range
    return [rng.integers(lo, hi, size=int(n)).tolist() for n in lengths]


def make_requests(
    n: int,
    *,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    token_id_range: tuple[int, int] = (10, 1000),
) -> list[RequestSpec]:
    """The seeded synthetic mix of requests with lengths uniform around a mean.

    :param n: how many.
    :param input_len: mean prompt length in tokens.
    :param output_len: mean output length in tokens.
    :param range_ratio: lengths are uniform in ``mean * [1 - r, 1 + r]`` (at
        least 1); ``0`` gives every request exactly the mean lengths.
    :param seed: the random seed (same seed, same requests).
    :param token_id_range: prompt token ids are drawn from ``[lo, hi)``.
    :return: ``n`` request specs.
    """
    rng = np.random.default_rng(seed)

    def lengths(mean: int) -> np.ndarray:
        lo = max(1, int(round(mean * (1 - range_ratio))))
        hi = max(lo, int(round(mean * (1 + range_ratio))))
        return rng.integers(lo, hi + 1, size=n)

    ins, outs = lengths(input_len), lengths(output_len)
    ids = _token_ids(rng, ins, token_id_range)
    return [RequestSpec(p, int(o)) for p, o in zip(ids, outs, strict=True)]


@dataclass(frozen=True)
class LogNormal:
    """A log-normal length law: ``exp(N(log(median), sigma))``, rounded to tokens.

    :param median: the median length in tokens.
    :param sigma: the standard deviation of the log-length.
    """

    median: float
    sigma: float

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw ``n`` lengths (unclipped, at least 1).

        :param rng: the generator.
        :param n: how many.
        :return: int64 lengths.
        """
        x = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.maximum(np.rint(x), 1).astype(np.int64)


SHAREGPT_INPUT = LogNormal(median=90.0, sigma=1.3)
"""Prompt lengths: most ShareGPT turns are short questions, a few paste long texts
(mean about 190 tokens once clipped to 1024)."""

SHAREGPT_OUTPUT = LogNormal(median=150.0, sigma=0.9)
"""Output lengths: answers of a few hundred tokens, a thinner tail than the prompts
(mean about 200 tokens once clipped)."""


def sharegpt_like_requests(
    n: int,
    *,
    seed: int,
    max_input_len: int = 1024,
    max_output_len: int = 1024,
    max_total_len: int = 2048,
    min_len: int = 4,
    token_id_range: tuple[int, int] = (10, 1000),
    input_len: int | None = None,
    output_len: int | None = None,
) -> list[RequestSpec]:
    """A seeded synthetic mix shaped like ShareGPT conversations.

    Prompt and output lengths are drawn from :data:`SHAREGPT_INPUT` and
    :data:`SHAREGPT_OUTPUT`, then clipped: each at least ``min_len``, prompts
    at most ``max_input_len``, outputs at most ``max_output_len`` and at most
    what ``max_total_len`` leaves after the prompt (vLLM drops such requests
    from the real data set; clipping keeps the count and the seed's meaning).
    ``input_len`` / ``output_len`` force one side to a fixed length (the
    limits do not apply to it); the other side keeps its draws.

    :param n: how many requests.
    :param seed: the random seed (same seed, same requests).
    :param max_input_len: longest prompt.
    :param max_output_len: longest output.
    :param max_total_len: longest prompt + output (e.g. the engine's ``max_model_len``).
    :param min_len: shortest prompt and output.
    :param token_id_range: prompt token ids are drawn from ``[lo, hi)``.
    :param input_len: every prompt has this many tokens (``None``: the mix).
    :param output_len: every request produces this many tokens (``None``: the mix).
    :return: ``n`` request specs.
    :raises ValueError: limits that leave no room for a request.
    """
    if max_total_len < 2 * min_len or min(max_input_len, max_output_len) < min_len:
        raise ValueError(
            f"the length limits (prompt {max_input_len}, output {max_output_len}, total "
            f"{max_total_len}) leave no room for requests of at least {min_len} tokens each"
        )
    rng = np.random.default_rng(seed)
    ins = np.clip(
        SHAREGPT_INPUT.sample(rng, n), min_len, min(max_input_len, max_total_len - min_len)
    )
    outs = SHAREGPT_OUTPUT.sample(rng, n)
    if input_len is not None:
        ins = np.full(n, input_len, dtype=np.int64)
    if output_len is not None:
        outs = np.full(n, output_len, dtype=np.int64)
    else:
        outs = np.clip(
            outs, min_len, np.maximum(min_len, np.minimum(max_output_len, max_total_len - ins))
        )
    return [
        RequestSpec(ids, int(o))
        for ids, o in zip(_token_ids(rng, ins, token_id_range), outs, strict=True)
    ]


def arrival_offsets(n: int, rate: float, seed: int) -> np.ndarray:
    """When each of ``n`` requests is sent, in seconds from the first: Poisson arrivals.

    :param n: how many requests.
    :param rate: requests per second; ``inf`` sends all at once.
    :param seed: the seed of the gaps.
    :return: ``n`` non-decreasing offsets, the first ``0``.
    """
    if n <= 0:
        return np.zeros(0)
    if not math.isfinite(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def percentile_ms(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile of seconds, in milliseconds (numpy's linear interpolation).

    :param values: durations in seconds.
    :param q: the percentile, 0..100.
    :return: milliseconds, or ``None`` without values.
    """
    return float(np.percentile(values, q) * 1e3) if values else None


def summarize(rate: float, results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Percentiles (ms) and throughputs of one run of requests.

    :param rate: the request rate (``inf``: all at once).
    :param results: one per request.
    :param duration: wall seconds from the first send to the last response.
    :return: a JSON-ready row.
    """
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [g for r in ok for g in r.itls]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    errors = sorted({r.error for r in results if r.error})

    def per_s(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    return {
        "rate": rate if math.isfinite(rate) else "inf",
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "output_token_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(out_tokens + prompt_tokens),
        "ttft_ms_p50": percentile_ms(ttft, 50),
        "ttft_ms_p99": percentile_ms(ttft, 99),
        "itl_ms_p50": percentile_ms(itl, 50),
        "itl_ms_p99": percentile_ms(itl, 99),
        "e2e_ms_p50": percentile_ms(e2e, 50),
        "e2e_ms_p99": percentile_ms(e2e, 99),
        "errors": errors[:5],
    }


def parse_rates(text: str, option: str) -> list[float]:
    """Parse request rates such as ``1,4,16,inf`` (``inf``: every request at once).

    :param text: comma-separated requests per second.
    :param option: the flag they came from, for errors.
    :return: the rates, in the order given.
    :raises ConfigError: a value that is not a positive number or ``inf``.
    """
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            r = math.inf if part in ("inf", "infinite") else float(part)
        except ValueError:
            raise ConfigError(
                f"option {option}: {part!r} is not a number; give requests per second such as "
                "1,4,16,inf"
            ) from None
        if not r > 0:
            raise ConfigError(f"option {option}: {part} must be > 0 (or inf)")
        rates.append(r)
    if not rates:
        raise ConfigError(f"option {option}: give at least one rate, e.g. 1,4,inf")
    return rates


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.1f}"


def print_table(rows: list[dict[str, Any]]) -> None:
    """Print one line per rate of :func:`summarize` rows, then their errors.

    :param rows: the rows, one per rate.
    """
    head = (
        f"{'rate':>6} {'done':>6} {'fail':>5} {'req/s':>7} {'tok/s':>8} {'total':>9} "
        f"{'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'e2e p50':>9} {'p99':>9}"
    )
    print(head + "   (tok/s: output tokens, total: prompt + output; latencies in ms)")
    for r in rows:
        print(
            f"{r['rate']!s:>6} {r['completed']:>6} {r['failed']:>5} "
            f"{r['request_throughput']:>7.2f} {r['output_token_throughput']:>8.1f} "
            f"{r['total_token_throughput']:>9.1f} "
            f"{_fmt(r['ttft_ms_p50']):>9} {_fmt(r['ttft_ms_p99']):>8} "
            f"{_fmt(r['itl_ms_p50']):>8} {_fmt(r['itl_ms_p99']):>8} "
            f"{_fmt(r['e2e_ms_p50']):>9} {_fmt(r['e2e_ms_p99']):>9}"
        )
    for r in rows:
        for e in r["errors"]:
            print(f"rate {r['rate']}: error: {e}")
