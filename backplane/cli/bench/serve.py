"""``backplane bench serve``: load a running server over HTTP at a sweep of request rates.

For each rate, ``--num-requests`` streaming ``/v1/completions`` requests are
sent with Poisson arrivals (``inf``: all at once). Prompts are random token ids
and output lengths are exact (``ignore_eos``), drawn from a seeded mix of
lengths (uniform within ``--input-len`` / ``--output-len`` +- ``--range-ratio``),
so two runs with one ``--seed`` send the same requests. Per rate it reports
time to first token (TTFT), inter-token latency (ITL: gaps between streamed
chunks) and end-to-end latency at p50 and p99, request and output-token
throughput, and failures; writes them to ``PREFIX.json`` and, with matplotlib
(the ``bench`` extra), a plot ``PREFIX.png``.

  backplane serve smollm2 --port 8000 &
  backplane bench serve --url http://127.0.0.1:8000 --rates 1,4,16,inf --num-requests 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from backplane.cli.bench.options import add_json_print
from backplane.cli.bench.workload import (
    RequestResult,
    RequestSpec,
    arrival_offsets,
    make_requests,
    parse_rates,
    print_table,
    summarize,
)
from backplane.core.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["RequestSpec", "RequestResult", "add_arguments", "make_requests", "run_cli", "summarize"]


async def _one(client: Any, url: str, model: str, spec: RequestSpec) -> RequestResult:
    body = {
        "model": model,
        "prompt": spec.prompt_token_ids,
        "max_tokens": spec.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last = None
    res = RequestResult(ok=False, prompt_tokens=len(spec.prompt_token_ids))
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {text[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message")
                    return res
                if chunk.get("usage"):
                    res.output_tokens = int(chunk["usage"]["completion_tokens"])
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
    except Exception as exc:  # a network error is a failed request, not a failed benchmark
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.e2e = time.perf_counter() - start
    res.ok = res.ttft is not None
    return res


async def _run_rate(
    url: str,
    model: str,
    specs: list[RequestSpec],
    rate: float,
    seed: int,
    api_key: str | None,
    max_concurrency: int | None,
) -> tuple[list[RequestResult], float]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    offsets = arrival_offsets(len(specs), rate, seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=None) as client:

        async def send(spec: RequestSpec) -> RequestResult:
            if gate is None:
                return await _one(client, url, model, spec)
            async with gate:
                return await _one(client, url, model, spec)

        tasks = []
        start = time.perf_counter()
        for spec, offset in zip(specs, offsets, strict=True):
            wait = start + float(offset) - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(send(spec)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def _model_of(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise ConfigError(
            f"cannot reach a server at {url} ({exc}); start one with `backplane serve MODEL` "
            "or pass --url"
        ) from None
    if r.status_code != 200:
        raise ConfigError(f"{url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    return r.json()["data"][0]["id"]


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Latency percentiles and throughput against the rate; ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'backplane[bench]'): no plot")
        return False
    labels = [str(r["rate"]) for r in rows]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, key, name in zip(
        axes[:3], ("ttft", "itl", "e2e"), ("TTFT", "ITL", "end-to-end"), strict=True
    ):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            vals = [r[f"{key}_ms_{q}"] if r[f"{key}_ms_{q}"] is not None else np.nan for r in rows]
            ax.plot(x, vals, style, label=q)
        ax.set_title(f"{name} (ms)")
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.legend()
        ax.grid(alpha=0.3)
    ax = axes[3]
    ax.plot(x, [r["output_token_throughput"] for r in rows], "o-")
    ax.set_title("output tokens / s")
    ax.set_xticks(x, labels)
    ax.set_xlabel("request rate (req/s)")
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``bench serve``."""
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", default=None, help="model name (default: the server's)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--rates", default="1,4,16,inf", help="requests per second to sweep; inf = all at once"
    )
    parser.add_argument(
        "--num-requests", type=int, default=100, metavar="N", help="requests per rate (100)"
    )
    parser.add_argument(
        "--input-len", type=int, default=256, metavar="N", help="mean prompt tokens (256)"
    )
    parser.add_argument(
        "--output-len", type=int, default=128, metavar="N", help="mean output tokens (128)"
    )
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.5,
        metavar="R",
        help="lengths uniform in mean*[1-R, 1+R] (0.5)",
    )
    parser.add_argument(
        "--token-id-range",
        default="10,1000",
        metavar="LO,HI",
        help="prompt token ids are drawn from [LO, HI) (10,1000: inside any real vocabulary)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix and arrivals")
    parser.add_argument(
        "--max-concurrency", type=int, default=None, metavar="N", help="most requests in flight"
    )
    parser.add_argument(
        "--output",
        default="bench_serve",
        metavar="PREFIX",
        help="write PREFIX.json and PREFIX.png (bench_serve)",
    )
    add_json_print(parser, "print the results as JSON")


def run_cli(args: argparse.Namespace) -> int:
    """Run the sweep, print the table, write the JSON and the plot; return 0."""
    try:
        import httpx  # noqa: F401
    except ModuleNotFoundError:
        raise ConfigError(
            "backplane bench serve needs httpx; install the bench extra: "
            "pip install 'backplane[bench]'"
        ) from None
    rates = parse_rates(args.rates, "--rates")
    for name in ("num_requests", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ConfigError(f"option --{name.replace('_', '-')}: must be at least 1")
    if not 0 <= args.range_ratio < 1:
        raise ConfigError("option --range-ratio: must be in [0, 1)")
    try:
        lo, hi = (int(v) for v in args.token_id_range.split(","))
    except ValueError:
        raise ConfigError("option --token-id-range: expected LO,HI such as 10,1000") from None
    if not 0 <= lo < hi:
        raise ConfigError("option --token-id-range: need 0 <= LO < HI")
    url = args.url.rstrip("/")
    model = args.model or _model_of(url, args.api_key)
    specs = make_requests(
        args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        seed=args.seed,
        token_id_range=(lo, hi),
    )
    rows = []
    for i, rate in enumerate(rates):
        logger.info("rate %s: %d requests", rate, len(specs))
        results, duration = asyncio.run(
            _run_rate(url, model, specs, rate, args.seed + i, args.api_key, args.max_concurrency)
        )
        rows.append(summarize(rate, results, duration))
    config = {
        k: getattr(args, k)
        for k in (
            "num_requests",
            "input_len",
            "output_len",
            "range_ratio",
            "token_id_range",
            "seed",
            "max_concurrency",
        )
    }
    result = {"url": url, "model": model, "config": config, "rates": rows}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path = out.with_name(out.name + ".json")
    json_path.write_text(json.dumps(result, indent=2), encoding="utf-8")
    png_path = out.with_name(out.name + ".png")
    title = (
        f"{model}: {args.num_requests} requests/rate, in {args.input_len} / out {args.output_len}"
    )
    plotted = plot(rows, png_path, title)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(rows)
        print(f"wrote {json_path}" + (f" and {png_path}" if plotted else ""))
    return 0
