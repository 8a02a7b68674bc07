"""Sweep launch configurations of the Triton attention kernels (GPU).

For each prefill shape (one prompt of N tokens) every ``(BLOCK_M, BLOCK_N,
num_warps, num_stages)`` is timed eagerly; for each decode shape (batch x
context) every ``(BLOCK_N, num_warps, num_stages)`` is timed as a CUDA-graph
replay at the default number of key splits, then the best configuration is
timed again at other split counts. The defaults of
:mod:`backplane.backends.triton.attention_configs` are chosen from these tables.

Layer: Llama-3-8B (32 query heads, 8 KV heads, head dim 128), bfloat16, page 16;
``--kv-cache-dtype fp8`` sweeps the decode over e4m3 pages::

    python benchmarks/tune_triton_attention.py [--quick] [--json out.jsonl]
    python benchmarks/tune_triton_attention.py --only decode --kv-cache-dtype fp8 \
        --decode-shapes 960:256,512:450,128:900,32:1200,1:512
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import ATTN, DT, _batch, _rnd, _time, graph_time  # noqa: E402

from backplane.backends.triton import attention_launch as tri  # noqa: E402
from backplane.backends.triton.attention_configs import _cfg, choose_num_splits  # noqa: E402

logger = logging.getLogger("tune_triton_attention")


def _case(query: list[int], cached: list[int]):
    batch, pages = _batch(query, cached)
    t, L = batch.padded_num_tokens, ATTN
    cache = _rnd(pages, 2, 16, L.num_kv_heads, L.head_dim)
    q = _rnd(t, L.num_heads, L.head_dim)
    kv = _rnd(t, 2, L.num_kv_heads, L.head_dim)  # this step's rows, appended by the kernels
    out = torch.empty(t, L.num_heads, L.head_dim, dtype=DT, device="cuda")
    return batch, q, kv, cache, out


def _flops(n: int) -> float:
    # causal: half of the full 2 * (QK + PV) matmuls
    return 2.0 * 2.0 * ATTN.num_heads * ATTN.head_dim * n * n / 2


def sweep_prefill(sizes: list[int], iters: int, rows: list[dict]) -> None:
    """Time every prefill configuration at each prompt length."""
    space = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)))
    for n in sizes:
        batch, q, kv, cache, out = _case([n], [0])
        kw = dict(
            scale=ATTN.head_dim**-0.5,
            group=ATTN.num_heads // ATTN.num_kv_heads,
            k_new=kv[:, 0],
            v_new=kv[:, 1],
        )
        best = None
        for bm, bn, w, st in space:
            cfg = _cfg(bm, bn, w, st)
            call = functools.partial(
                tri.paged_prefill, batch, q, cache[:, 0], cache[:, 1], out, configs=[cfg], **kw
            )
            try:
                ms = _time(call, 2, iters)
            except Exception as exc:  # noqa: BLE001 - a config that does not fit is skipped
                logger.info("prefill %d %s: %s", n, cfg, type(exc).__name__)
                continue
            row = dict(op="prefill", n=n, cfg=cfg, us=ms * 1e3, tflops=_flops(n) / ms / 1e9)
            rows.append(row)
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best is not None:
            print(f"prefill {n}: best {best[1]} {best[0] * 1e3:.1f} us "
                  f"({_flops(n) / best[0] / 1e9:.0f} TF/s)", flush=True)  # fmt: skip


#: the scale of the e4m3 cache of ``--kv-cache-dtype fp8`` (the random rows stay in range)
FP8_SCALE = 0.05


def sweep_decode(
    shapes: list[tuple[int, int]], iters: int, rows: list[dict], fp8: bool = False
) -> None:
    """Time every decode configuration (graph replay), then split counts for the best one.

    With ``fp8`` the cache holds e4m3 pages (one byte a value; the queries stay bfloat16).
    """
    space = list(itertools.product((32, 64, 128), (4, 8), (2, 3, 4)))
    group = ATTN.num_heads // ATTN.num_kv_heads
    for b, ctx in shapes:
        batch, q, kv, cache, out = _case([1] * b, [ctx - 1] * b)
        scale = 1.0
        if fp8:
            cache = (cache / FP8_SCALE).to(torch.float8_e4m3fn)
            scale = FP8_SCALE
        auto = choose_num_splits(batch, ATTN.num_kv_heads, q.device)
        kv_bytes = 2 * b * ctx * ATTN.num_kv_heads * ATTN.head_dim * cache.element_size()

        call = functools.partial(
            tri.paged_decode, batch, q, cache[:, 0], cache[:, 1], out,
            scale=ATTN.head_dim**-0.5, group=group, k_new=kv[:, 0], v_new=kv[:, 1],
            k_scale=scale, v_scale=scale,
        )  # fmt: skip

        def run(cfg, splits, call=call):
            return graph_time(functools.partial(call, num_splits=splits, configs=[cfg]), iters)

        best = None
        for bn, w, st in space:
            cfg = _cfg(None, bn, w, st)
            try:
                ms = run(cfg, auto)
            except Exception as exc:  # noqa: BLE001
                logger.info("decode %dx%d %s: %s", b, ctx, cfg, type(exc).__name__)
                continue
            rows.append(dict(op="decode", b=b, ctx=ctx, cfg=cfg, splits=auto, us=ms * 1e3,
                             tbps=kv_bytes / ms / 1e9))  # fmt: skip
            if best is None or ms < best[0]:
                best = (ms, cfg, auto)
        if best is None:
            continue
        for splits in sorted({max(1, auto // 2), auto * 2, auto * 4, 64, 128} - {auto}):
            try:
                ms = run(best[1], splits)
            except Exception as exc:  # noqa: BLE001
                logger.info("decode %dx%d splits %d: %s", b, ctx, splits, type(exc).__name__)
                continue
            rows.append(dict(op="decode", b=b, ctx=ctx, cfg=best[1], splits=splits,
                             us=ms * 1e3, tbps=kv_bytes / ms / 1e9))  # fmt: skip
            if ms < best[0]:
                best = (ms, best[1], splits)
        print(f"decode b={b} ctx={ctx}: best {best[1]} splits={best[2]} (auto {auto}) "
              f"{best[0] * 1e3:.1f} us, {kv_bytes / best[0] / 1e9:.2f} TB/s", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the sweeps; print the best configuration per shape and optionally dump every row."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per point")
    parser.add_argument("--json", help="append every measured row to this JSON-lines file")
    parser.add_argument("--only", choices=("prefill", "decode"), help="sweep one kernel")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="the decode sweep's cache: auto (bfloat16) or fp8 (e4m3 pages)",
    )
    parser.add_argument(
        "--decode-shapes",
        metavar="B:CTX,...",
        help="decode shapes as batch:context pairs (default: batches 1, 16, 64 at "
        "contexts 1024, 8192, 32768)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    rows: list[dict] = []
    if args.only != "decode":
        sweep_prefill([1024, 4096] if args.quick else [1024, 4096, 16384], args.iters, rows)
    if args.only != "prefill":
        ctxs = (1024, 32768) if args.quick else (1024, 8192, 32768)
        shapes = [(b, c) for b in (1, 16, 64) for c in ctxs]
        if args.decode_shapes:
            shapes = [
                (int(b), int(c)) for b, c in (p.split(":") for p in args.decode_shapes.split(","))
            ]
        sweep_decode(shapes, args.iters, rows, fp8=args.kv_cache_dtype == "fp8")
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
