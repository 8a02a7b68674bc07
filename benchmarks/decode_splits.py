"""Triton decode attention per layer by key-split count and launch configuration (GPU).

A decode step runs the attention op once per layer, each on its own cache, so a
single call timed alone mostly measures the graph launch. This script captures
the decode calls of ``--layers`` layers (distinct caches) in one CUDA graph and
reports microseconds per layer, for each split count and each configuration of
a small set, at the Llama-1B layer shape of ``backplane bench latency`` (32
query / 8 KV heads of 64, bfloat16, page 16). ``choose_num_splits``'s choice is
marked ``(auto)``; the split counts it picks come from these tables.

    python benchmarks/decode_splits.py [--shapes 1x576,8x576,1x2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import DT, _batch, _rnd, graph_time  # noqa: E402

from backplane.backends.triton import attention_launch as tri  # noqa: E402
from backplane.backends.triton.attention_configs import _cfg, choose_num_splits  # noqa: E402

logger = logging.getLogger("decode_splits")

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64
CONFIGS: list[dict | None] = [None] + [
    _cfg(None, bn, w, st)
    for bn, w, st in ((32, 4, 2), (64, 4, 2), (128, 4, 2), (64, 2, 2), (32, 2, 1), (128, 8, 2))
]
"""``None`` = the defaults of ``attention_configs``, then the candidates."""


def per_layer_us(fn: Callable[[], None], layers: int, repeats: int = 15) -> float:
    """Median microseconds per layer of ``fn`` (all layers' calls) replayed in a CUDA graph."""
    return graph_time(fn, repeats) * 1e3 / layers


def sweep(batch_size: int, ctx: int, splits_list: list[int], layers: int) -> list[dict]:
    """Time every (split count, configuration) pair at one batch size and context."""
    batch, pages = _batch([1] * batch_size, [ctx - 1] * batch_size)
    caches = [_rnd(pages, 2, 16, KV_HEADS, HEAD_DIM) for _ in range(layers)]
    q = _rnd(batch_size, HEADS, HEAD_DIM)
    kv = _rnd(batch_size, 2, KV_HEADS, HEAD_DIM)
    out = torch.empty(batch_size, HEADS, HEAD_DIM, dtype=DT, device="cuda")
    auto = choose_num_splits(batch, KV_HEADS, q.device)
    rows = []
    for splits in splits_list:
        for cfg in CONFIGS:

            def run(splits: int = splits, cfg: dict | None = cfg) -> None:
                for c in caches:
                    tri.paged_decode(
                        batch, q, c[:, 0], c[:, 1], out,
                        scale=HEAD_DIM**-0.5, group=HEADS // KV_HEADS,
                        k_new=kv[:, 0], v_new=kv[:, 1],
                        num_splits=splits, configs=None if cfg is None else [cfg],
                    )  # fmt: skip

            try:
                us = per_layer_us(run, layers)
            except Exception as exc:  # noqa: BLE001 - a config that does not fit is skipped
                logger.info("b=%d ctx=%d splits=%d %s: %s", batch_size, ctx, splits, cfg, exc)
                continue
            rows.append(dict(b=batch_size, ctx=ctx, splits=splits, auto=auto, cfg=cfg, us=us))
        done = [r for r in rows if r["splits"] == splits]
        if done:
            default = next((r["us"] for r in done if r["cfg"] is None), float("nan"))
            best = min(done, key=lambda r: r["us"])
            mark = " (auto)" if splits == auto else ""
            print(f"b={batch_size} ctx={ctx} splits={splits}{mark}: default {default:.2f} us/layer,"
                  f" best {best['us']:.2f} {best['cfg']}", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the sweep for each ``BxCTX`` shape and print one line per split count."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--shapes", default="1x576,8x576,1x2048", help="batch x context, comma-separated"
    )
    p.add_argument("--splits", default="1,2,4,8,16,32", help="split counts, comma-separated")
    p.add_argument("--layers", type=int, default=16, help="layers (distinct caches) per graph")
    p.add_argument("--json", help="write every measured row here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    splits = [int(s) for s in args.splits.split(",")]
    rows: list[dict] = []
    for shape in args.shapes.split(","):
        b, ctx = (int(v) for v in shape.lower().split("x"))
        rows += sweep(b, ctx, splits, args.layers)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
