"""Each op family on FlashInfer vs Triton vs torch, side by side, at decode and prefill shapes.

For every family the same inputs run through every available backend of the
registry (``flashinfer``, ``triton``, ``torch``) via the family contract
(``plan`` once, then the cached op with an ``out`` buffer), timed with CUDA events
(median of ``--iters`` after ``--warmup`` runs; ``plan`` is timed separately).

Reported per shape and backend: time (us), bytes the op must move at least
(KV/latent/state read + written), that as a fraction of the GPU's HBM peak, the
achieved TFLOP/s for prefill, and the ratio to the FlashInfer time.

Shapes (bfloat16):

* attention: Llama-3-8B layer (32 heads, 8 KV heads, head dim 128), page 16;
  decode batch x context, prefill one prompt of N tokens;
* mla: DeepSeek-V3 layer at TP8 (16 heads, latent 512 + rope 64, nope 128, v 128);
* ssm: Nemotron-H Mamba2 layer (128 heads x 64, state 128, 8 groups); decode is
  independent of context, prefill one prompt of N tokens;
* delta: Qwen3-Next GDN layer (16 key heads, 32 value heads, head dim 128).

Run: ``python benchmarks/bench_ops_flashinfer.py [--quick] [--json out.jsonl] [--md out.md]``
(GPU only; FlashInfer kernels should be warm: ``backplane warmup``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from backplane.core.families import AttentionLayerSpec, DeltaLayerSpec, MLALayerSpec, SSMLayerSpec
from backplane.core.forward_context import forward_context
from backplane.core.packing import build_batch_metadata
from backplane.core.registry import get_registry
from backplane.engine.selection import load_backend, select_backend

logger = logging.getLogger("bench_ops_flashinfer")

#: Spec-sheet HBM bandwidth (bytes/s) by device-name fragment.
PEAK_BW = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40": 0.864e12}
BACKENDS = ("flashinfer", "triton", "torch")
DT = torch.bfloat16
PAGE = 16

ATTN = AttentionLayerSpec(0, num_heads=32, num_kv_heads=8, head_dim=128)
MLA = MLALayerSpec(0, 16, 512, 128, 64, 128, 192**-0.5)
SSM = SSMLayerSpec(0, nheads=128, head_dim=64, d_state=128, n_groups=8, chunk_size=256)
DELTA = DeltaLayerSpec(0, num_k_heads=16, num_v_heads=32, k_head_dim=128, v_head_dim=128)

#: Largest problem (sequences x context tokens) the torch reference backends are run on;
#: they loop over sequences in Python and are far slower at larger sizes.
TORCH_MAX_TOKENS = 1 << 17
#: Longest prompt the torch reference backends are run on (they materialise the scores).
TORCH_MAX_PREFILL = 4096


def peak_bandwidth() -> float:
    """HBM peak of the current GPU (spec sheet; measured copy bandwidth when unknown)."""
    name = torch.cuda.get_device_name()
    for key, bw in PEAK_BW.items():
        if key in name:
            return bw
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = _time(lambda: y.copy_(x), 3, 10)
    return 2 * x.numel() / (ms * 1e-3)


def _time(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _batch(query: list[int], cached: list[int]):
    """Sequences get consecutive pages starting at 1 (page 0 is the reserved scratch page)."""
    tables, nxt = [], 1
    for q, c in zip(query, cached, strict=True):
        need = -(-(q + c) // PAGE)
        tables.append(range(nxt, nxt + need))
        nxt += need
    batch = build_batch_metadata(
        query, cached, tables, PAGE, state_slots=list(range(1, len(query) + 1)), device="cuda"
    )
    return batch, nxt


def _rnd(*shape: int, scale: float = 1.0, dtype: torch.dtype = DT) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def _case(family: str, backend: Any, query: list[int], cached: list[int]):
    """Inputs and a closure running ``backend``'s op once on them (out buffer reused)."""
    batch, num_pages = _batch(query, cached)
    t = batch.padded_num_tokens
    n = len(query)
    if family == "attention":
        L = ATTN
        cache = torch.zeros(num_pages, 2, PAGE, L.num_kv_heads, L.head_dim, dtype=DT, device="cuda")
        args = (
            _rnd(t, L.num_heads, L.head_dim),
            _rnd(t, L.num_kv_heads, L.head_dim),
            _rnd(t, L.num_kv_heads, L.head_dim),
            cache,
            L,
        )
        out = torch.empty(t, L.num_heads, L.head_dim, dtype=DT, device="cuda")
        call = backend.forward
    elif family == "mla":
        L = MLA
        cache = torch.zeros(num_pages, PAGE, 576, dtype=DT, device="cuda")
        args = (
            _rnd(t, 16, 128),
            _rnd(t, 16, 64),
            _rnd(t, 512),
            _rnd(t, 64),
            cache,
            _rnd(16, 128, 512, scale=0.04),
            _rnd(16, 128, 512, scale=0.04),
            L,
        )
        out = torch.empty(t, 16, 128, dtype=DT, device="cuda")
        call = backend.forward
    elif family == "ssm":
        L = SSM
        state = torch.zeros(n + 1, L.nheads, L.head_dim, L.d_state, device="cuda")
        args = (
            _rnd(t, L.nheads, L.head_dim),
            _rnd(t, L.nheads, scale=0.5),
            -torch.rand(L.nheads, device="cuda") - 0.5,
            _rnd(t, L.n_groups, L.d_state, scale=0.3),
            _rnd(t, L.n_groups, L.d_state, scale=0.3),
            torch.randn(L.nheads, device="cuda"),
            torch.randn(L.nheads, device="cuda") * 0.5,
            _rnd(t, L.nheads, L.head_dim),
            state,
            L,
        )
        out = torch.empty(t, L.nheads, L.head_dim, dtype=DT, device="cuda")
        call = backend.scan
    else:
        L = DELTA
        state = torch.zeros(n + 1, L.num_v_heads, L.k_head_dim, L.v_head_dim, device="cuda")
        args = (
            _rnd(t, L.num_k_heads, L.k_head_dim),
            _rnd(t, L.num_k_heads, L.k_head_dim),
            _rnd(t, L.num_v_heads, L.v_head_dim),
            -torch.rand(t, L.num_v_heads, device="cuda") * 0.1,
            torch.rand(t, L.num_v_heads, device="cuda") * 0.5 + 0.25,
            state,
            L,
        )
        out = torch.empty(t, L.num_v_heads, L.v_head_dim, dtype=DT, device="cuda")
        call = backend.forward

    def run(plan: Any) -> None:
        with forward_context(batch, {family: plan}):
            call(*args, out=out)

    return batch, run


def _bytes_and_flops(family: str, query: list[int], cached: list[int]) -> tuple[float, float]:
    """Minimum HBM traffic (bytes) and useful FLOPs of one op call."""
    ctx = [q + c for q, c in zip(query, cached, strict=True)]
    tok = sum(query)
    n = len(query)
    if family == "attention":
        L = ATTN
        kv = sum(ctx) * L.num_kv_heads * L.head_dim * 2 * 2
        io = tok * (L.num_heads * 2 + L.num_kv_heads * 2) * L.head_dim * 2
        flops = sum(
            4 * L.num_heads * L.head_dim * q * (c + (q + 1) / 2)
            for q, c in zip(query, cached, strict=True)
        )
        return kv + io, flops
    if family == "mla":
        lat = sum(ctx) * 576 * 2
        io = tok * (16 * (128 + 64 + 128) + 576) * 2
        flops = sum(
            2 * 16 * (576 + 512) * q * (c + (q + 1) / 2) for q, c in zip(query, cached, strict=True)
        )
        return lat + io, flops
    if family == "ssm":
        L = SSM
        state = n * L.nheads * L.head_dim * L.d_state * 4 * 2
        io = tok * (3 * L.nheads * L.head_dim + 2 * L.n_groups * L.d_state) * 2
        return state + io, tok * L.nheads * L.head_dim * L.d_state * 6
    L = DELTA
    state = n * L.num_v_heads * L.k_head_dim * L.v_head_dim * 4 * 2
    io = tok * (2 * L.num_k_heads * L.k_head_dim + 2 * L.num_v_heads * L.v_head_dim) * 2
    return state + io, tok * L.num_v_heads * L.k_head_dim * L.v_head_dim * 8


def shapes(quick: bool) -> list[tuple[str, str, list[int], list[int]]]:
    """``(family, label, query_lens, cached_lens)`` of every measured point."""
    batches = [1, 16, 64, 256] if quick else [1, 8, 32, 64, 128, 256]
    contexts = [1024, 8192, 32768] if quick else [1024, 4096, 8192, 16384, 32768]
    prefills = [1024, 4096, 16384] if quick else [1024, 2048, 4096, 8192, 16384]
    out = []
    for fam in ("attention", "mla"):
        for b in batches:
            for c in contexts:
                if b * c > (1 << 23):  # 8M tokens of KV: beyond this the cache alone is > 32 GiB
                    continue
                out.append((fam, f"decode b={b} ctx={c}", [1] * b, [c - 1] * b))
        for p in prefills:
            out.append((fam, f"prefill {p}", [p], [0]))
    for fam in ("ssm", "delta"):
        for b in batches:
            out.append((fam, f"decode b={b}", [1] * b, [1024] * b))
        for p in prefills:
            out.append((fam, f"prefill {p}", [p], [0]))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a markdown table (and write JSON lines / markdown if asked)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller grid of shapes")
    ap.add_argument("--families", default="attention,mla,ssm,delta")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", help="append one JSON object per measurement to this file")
    ap.add_argument("--md", help="write the markdown table to this file")
    ap.add_argument("--time-budget", type=float, default=0, help="stop after this many seconds")
    ap.add_argument(
        "--label", default="", help="suffix for the flashinfer backend's name in the output"
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ops_flashinfer needs a CUDA GPU", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    registry = get_registry()
    families = args.families.split(",")
    backends: dict[str, dict[str, Any]] = {}
    for fam in families:
        backends[fam] = {}
        for name in args.backends.split(","):
            try:
                backends[fam][name] = load_backend(
                    select_backend(fam, name, registry=registry), registry=registry
                )
            except Exception as exc:
                logger.info("%s/%s not benchmarked: %s", fam, name, exc)
    peak = peak_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"# {device}; HBM peak {peak / 1e12:.2f} TB/s; bfloat16; median of {args.iters}")
    rows = []
    start = time.time()
    jf = open(args.json, "a") if args.json else None  # noqa: SIM115
    for fam, label, query, cached in shapes(args.quick):
        if fam not in families:
            continue
        if args.time_budget and time.time() - start > args.time_budget:
            print(f"time budget reached; stopping before {fam} {label}")
            break
        nbytes, flops = _bytes_and_flops(fam, query, cached)
        results: dict[str, dict[str, float]] = {}
        for name, backend in backends[fam].items():
            if name == "torch" and (
                sum(q + c for q, c in zip(query, cached, strict=True)) > TORCH_MAX_TOKENS
                or max(query) > TORCH_MAX_PREFILL
            ):
                continue
            try:
                batch, run = _case(fam, backend, query, cached)
                t0 = time.perf_counter()
                plan = backend.plan(batch)
                torch.cuda.synchronize()
                plan_us = (time.perf_counter() - t0) * 1e6
                ms = _time(lambda plan=plan, run=run: run(plan), args.warmup, args.iters)
                results[name] = {"us": ms * 1e3, "plan_us": plan_us}
            except Exception as exc:
                logger.info("%s %s on %s failed: %s: %s", fam, label, name, type(exc).__name__, exc)
                results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
            finally:
                torch.cuda.empty_cache()
        ref = results.get("flashinfer", {}).get("us")
        for name, r in results.items():
            shown = f"{name}{args.label}" if name == "flashinfer" else name
            rec = {"device": device, "family": fam, "shape": label, "backend": shown, **r}
            if "us" in r:
                rec["bw_pct"] = 100 * nbytes / (r["us"] * 1e-6) / peak
                rec["tflops"] = flops / (r["us"] * 1e-6) / 1e12
                rec["vs_flashinfer"] = r["us"] / ref if ref else None
            rows.append(rec)
            if jf:
                jf.write(json.dumps(rec) + "\n")
                jf.flush()
            print(_fmt(rec), flush=True)
    if jf:
        jf.close()
    md = markdown(rows, device, peak)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    return 0


def _fmt(r: dict[str, Any]) -> str:
    if "us" not in r:
        return f"{r['family']:9s} {r['shape']:24s} {r['backend']:10s} {r.get('error', '')}"
    vs = r.get("vs_flashinfer")
    return (
        f"{r['family']:9s} {r['shape']:24s} {r['backend']:10s} {r['us']:10.1f} us "
        f"{r['bw_pct']:6.1f}% HBM {r['tflops']:7.1f} TFLOP/s "
        f"x{vs:.2f} vs flashinfer"
        if vs
        else f"{r['family']:9s} {r['shape']:24s} {r['backend']:10s} {r['us']:10.1f} us"
    )


def markdown(rows: list[dict[str, Any]], device: str, peak: float) -> str:
    """One table per family: a row per shape, time / HBM % per backend, ratios to FlashInfer."""
    out = [f"Measured on {device} (HBM peak {peak / 1e12:.2f} TB/s), bfloat16.\n"]
    fams = list(dict.fromkeys(r["family"] for r in rows))
    for fam in fams:
        names = list(dict.fromkeys(r["backend"] for r in rows if r["family"] == fam))
        out.append(f"\n### {fam}\n")
        head = "| shape | " + " | ".join(f"{n} us (HBM %)" for n in names)
        others = [n for n in names if n != names[0]]
        head += " | " + " | ".join(f"{n}/{names[0]}" for n in others) + " |"
        out.append(head)
        out.append("|" + "---|" * (1 + len(names) + len(others)))
        for shape in dict.fromkeys(r["shape"] for r in rows if r["family"] == fam):
            cell = {r["backend"]: r for r in rows if r["family"] == fam and r["shape"] == shape}
            vals = []
            for n in names:
                r = cell.get(n)
                if r is None:
                    vals.append("-")
                elif "us" in r:
                    extra = (
                        f" ({r['bw_pct']:.0f}%)"
                        if "decode" in shape
                        else f" ({r['tflops']:.0f} TF/s)"
                    )
                    vals.append(f"{r['us']:.1f}{extra}")
                else:
                    vals.append("error")
            ratios = []
            first = cell.get(names[0], {}).get("us")
            for n in others:
                r = cell.get(n)
                ratios.append(f"{r['us'] / first:.2f}" if r and "us" in r and first else "-")
            out.append(f"| {shape} | " + " | ".join(vals) + " | " + " | ".join(ratios) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
