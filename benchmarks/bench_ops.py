"""Per-op timing of the Triton backends against the torch backends (GPU).

Every op runs through its family contract (``plan`` once per shape, then the
cached op with a reused ``out`` buffer), timed with CUDA events: the median of
``--iters`` runs after ``--warmup``. For each shape the table gives the time of
each backend, the bytes the op must move at least (KV / latent / state read,
state written, inputs and outputs) as a percentage of the **measured** HBM
bandwidth (a large device-to-device copy, read + write bytes per second), and
the ratio torch time / Triton time (the speed-up, both eager). Decode shapes of
the non-torch backends are also timed as one CUDA-graph replay (decode runs in
graphs in the engine; eager times of small decode batches are mostly host launch
overhead). With ``--backends`` including ``flashinfer`` the ratio Triton /
FlashInfer (eager) is given as well.

Shapes (bfloat16, page size 16):

* attention: a Llama-3-8B layer (32 query heads, 8 KV heads, head dim 128),
  decode ``batch x context`` and one prefill prompt;
* mla: a DeepSeek-V3 layer at 16 heads (latent 512 + rope 64, nope 128, v 128);
* ssm: a Nemotron-H Mamba2 layer (128 heads x 64, state 128, 8 groups);
* delta: a Qwen3-Next gated-delta layer (16 key heads, 32 value heads, 128 x 128).

Run on the GPU machine::

    python benchmarks/bench_ops.py [--quick] [--md docs/benchmarks/triton.md] [--json out.jsonl]
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

logger = logging.getLogger("bench_ops")

DT = torch.bfloat16
PAGE = 16
ATTN = AttentionLayerSpec(0, num_heads=32, num_kv_heads=8, head_dim=128)
MLA = MLALayerSpec(0, 16, 512, 128, 64, 128, 192**-0.5)
SSM = SSMLayerSpec(0, nheads=128, head_dim=64, d_state=128, n_groups=8, chunk_size=256)
DELTA = DeltaLayerSpec(0, num_k_heads=16, num_v_heads=32, k_head_dim=128, v_head_dim=128)
#: The torch reference backends loop over sequences in Python; keep them to modest sizes.
TORCH_MAX_KV_TOKENS = 1 << 17
TORCH_MAX_PREFILL = 4096


def _time(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn`` measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_time(fn: Callable[[], Any], iters: int) -> float:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph (no launch overhead).

    Decode steps run inside CUDA graphs in the engine, so this is the figure that
    the bandwidth of a decode op should be judged by.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _time(graph.replay, 2, iters)


def measured_bandwidth() -> float:
    """HBM bandwidth measured by a 2 GiB device copy: (read + written bytes) / second."""
    buffers = [torch.empty(1 << 31, dtype=torch.uint8, device="cuda") for _ in range(2)]
    ms = _time(lambda: buffers[1].copy_(buffers[0]), 3, 10)
    buffers.clear()
    torch.cuda.empty_cache()
    return 2 * (1 << 31) / (ms * 1e-3)


def _batch(query: list[int], cached: list[int]):
    tables, nxt = [], 1  # page 0 is the reserved scratch page
    for q, c in zip(query, cached, strict=True):
        need = -(-(q + c) // PAGE)
        tables.append(range(nxt, nxt + need))
        nxt += need
    slots = list(range(1, len(query) + 1))
    return build_batch_metadata(query, cached, tables, PAGE, state_slots=slots, device="cuda"), nxt


def _rnd(*shape: int, scale: float = 1.0, dtype: torch.dtype = DT) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def make_case(family: str, query: list[int], cached: list[int]):
    """Inputs for one shape: ``(batch, call(backend, out) -> None, out buffer)``."""
    batch, pages = _batch(query, cached)
    t, n = batch.padded_num_tokens, len(query)
    if family == "attention":
        L = ATTN
        cache = _rnd(pages, 2, PAGE, L.num_kv_heads, L.head_dim)
        q, k, v = (_rnd(t, h, L.head_dim) for h in (L.num_heads, L.num_kv_heads, L.num_kv_heads))
        out = torch.empty(t, L.num_heads, L.head_dim, dtype=DT, device="cuda")
        return batch, lambda b, o: b.forward(q, k, v, cache, L, out=o), out
    if family == "mla":
        L = MLA
        cache = _rnd(pages, PAGE, L.kv_lora_rank + L.qk_rope_head_dim)
        args = (
            _rnd(t, L.num_heads, L.qk_nope_head_dim),
            _rnd(t, L.num_heads, L.qk_rope_head_dim),
            _rnd(t, L.kv_lora_rank),
            _rnd(t, L.qk_rope_head_dim),
            cache,
            _rnd(L.num_heads, L.qk_nope_head_dim, L.kv_lora_rank, scale=0.04),
            _rnd(L.num_heads, L.v_head_dim, L.kv_lora_rank, scale=0.04),
        )
        out = torch.empty(t, L.num_heads, L.v_head_dim, dtype=DT, device="cuda")
        return batch, lambda b, o: b.forward(*args, L, out=o), out
    if family == "ssm":
        L = SSM
        state = torch.randn(n + 1, L.nheads, L.head_dim, L.d_state, device="cuda") * 0.1
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
        )
        out = torch.empty(t, L.nheads, L.head_dim, dtype=DT, device="cuda")
        return batch, lambda b, o: b.scan(*args, L, out=o), out
    L = DELTA
    state = torch.randn(n + 1, L.num_v_heads, L.k_head_dim, L.v_head_dim, device="cuda") * 0.1
    args = (
        _rnd(t, L.num_k_heads, L.k_head_dim),
        _rnd(t, L.num_k_heads, L.k_head_dim),
        _rnd(t, L.num_v_heads, L.v_head_dim),
        -torch.rand(t, L.num_v_heads, device="cuda") * 0.1,
        torch.rand(t, L.num_v_heads, device="cuda") * 0.5 + 0.25,
        state,
    )
    out = torch.empty(t, L.num_v_heads, L.v_head_dim, dtype=DT, device="cuda")
    return batch, lambda b, o: b.forward(*args, L, out=o), out


def min_bytes(family: str, query: list[int], cached: list[int]) -> float:
    """Least HBM traffic of one call: caches/states read (+ written) and the token I/O."""
    tok, n = sum(query), len(query)
    ctx = sum(q + c for q, c in zip(query, cached, strict=True))
    if family == "attention":
        L = ATTN
        return (
            ctx * L.num_kv_heads * L.head_dim * 2 * 2
            + tok * (2 * L.num_heads + 2 * L.num_kv_heads) * L.head_dim * 2
        )
    if family == "mla":
        L = MLA
        width = L.kv_lora_rank + L.qk_rope_head_dim
        io = tok * (L.num_heads * (L.qk_nope_head_dim + L.qk_rope_head_dim + L.v_head_dim) + width)
        return (ctx * width + io) * 2
    if family == "ssm":
        L = SSM
        state = n * L.nheads * L.head_dim * L.d_state * 4 * 2
        return state + tok * (3 * L.nheads * L.head_dim + 2 * L.n_groups * L.d_state + L.nheads) * 2
    L = DELTA
    state = n * L.num_v_heads * L.k_head_dim * L.v_head_dim * 4 * 2
    io = tok * (2 * L.num_k_heads * L.k_head_dim + 2 * L.num_v_heads * (L.v_head_dim + 1))
    return state + io * 2


def shapes(quick: bool) -> list[tuple[str, str, list[int], list[int]]]:
    """``(family, label, query_lens, cached_lens)`` of every measured point."""
    batches = [1, 32, 128] if quick else [1, 8, 32, 64, 128]
    contexts = [4096, 32768] if quick else [1024, 4096, 16384, 32768]
    prefills = [2048] if quick else [1024, 4096, 8192]
    rows = []
    for fam in ("attention", "mla"):
        for b in batches:
            for c in contexts:
                if b * c <= 1 << 22:
                    rows.append((fam, f"decode b={b} ctx={c}", [1] * b, [c - 1] * b))
        for p in prefills:
            rows.append((fam, f"prefill {p}", [p], [0]))
        rows.append((fam, "extend 4x512 on 2048", [512] * 4, [2048] * 4))
    for fam in ("ssm", "delta"):
        for b in batches:
            rows.append((fam, f"decode b={b}", [1] * b, [1024] * b))
        for p in prefills:
            rows.append((fam, f"prefill {p}", [p], [0]))
        rows.append((fam, "extend 4x512", [512] * 4, [2048] * 4))
    return rows


def markdown(rows: list[dict[str, Any]], device: str, bw: float, names: list[str]) -> str:
    """One table per family: time and HBM % per backend, torch/triton (and triton/flashinfer)."""
    out = [f"Measured on {device}; measured HBM copy bandwidth {bw / 1e12:.2f} TB/s; bfloat16.\n"]
    for fam in dict.fromkeys(r["family"] for r in rows):
        out.append(f"\n### {fam}\n")
        cols = [f"{n} us (HBM %)" for n in names]
        cols += [f"{n} graph us (HBM %)" for n in names if n != "torch"] + ["torch / triton"]
        if "flashinfer" in names:
            cols.append("triton / flashinfer")
        out.append("| shape | " + " | ".join(cols) + " |")
        out.append("|---" * (len(cols) + 1) + "|")
        for shape in dict.fromkeys(r["shape"] for r in rows if r["family"] == fam):
            cell = {r["backend"]: r for r in rows if r["family"] == fam and r["shape"] == shape}
            vals = []
            for n in names:
                r = cell.get(n)
                vals.append(
                    "-"
                    if r is None
                    else f"{r['us']:.1f} ({r['bw_pct']:.0f}%)"
                    if "us" in r
                    else "error"
                )
            for n in names:
                if n == "torch":
                    continue
                r = cell.get(n, {})
                vals.append(
                    f"{r['graph_us']:.1f} ({r['graph_bw_pct']:.0f}%)" if "graph_us" in r else "-"
                )
            tri = cell.get("triton", {}).get("us")
            for other, inverse in (("torch", False), ("flashinfer", True)):
                if other == "flashinfer" and "flashinfer" not in names:
                    continue
                o = cell.get(other, {}).get("us")
                vals.append(f"{(tri / o if inverse else o / tri):.2f}" if tri and o else "-")
            out.append(f"| {shape} | " + " | ".join(vals) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print lines as it goes and a markdown table at the end."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller grid of shapes")
    ap.add_argument("--families", default="attention,mla,ssm,delta")
    ap.add_argument("--backends", default="triton,torch", help="e.g. triton,torch,flashinfer")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--time-budget", type=float, default=0, help="stop after this many seconds")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph decode timing")
    ap.add_argument("--json", help="append one JSON object per measurement")
    ap.add_argument("--md", help="write the markdown tables here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ops needs a CUDA GPU", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    families = args.families.split(",")
    names = args.backends.split(",")
    registry = get_registry()
    backends: dict[str, dict[str, Any]] = {f: {} for f in families}
    for fam in families:
        for name in names:
            try:
                backends[fam][name] = load_backend(
                    select_backend(fam, name, registry=registry), registry=registry
                )
            except Exception as exc:
                logger.info("%s/%s not benchmarked: %s", fam, name, exc)
    bw = measured_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"# {device}: measured copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows: list[dict[str, Any]] = []
    jf = open(args.json, "a") if args.json else None  # noqa: SIM115
    start = time.time()
    for fam, label, query, cached in shapes(args.quick):
        if fam not in families:
            continue
        if args.time_budget and time.time() - start > args.time_budget:
            print(f"time budget reached before {fam} {label}", flush=True)
            break
        nbytes = min_bytes(fam, query, cached)
        for name, backend in backends[fam].items():
            kv_tokens = sum(q + c for q, c in zip(query, cached, strict=True))
            if name == "torch" and (
                kv_tokens > TORCH_MAX_KV_TOKENS or max(query) > TORCH_MAX_PREFILL
            ):
                continue
            rec: dict[str, Any] = {"device": device, "family": fam, "shape": label, "backend": name}
            try:
                batch, call, out = make_case(fam, query, cached)
                plan = backend.plan(batch)

                def run(
                    backend=backend, batch=batch, plan=plan, call=call, out=out, fam=fam
                ) -> None:
                    with forward_context(batch, {fam: plan}):
                        call(backend, out)

                ms = _time(run, args.warmup, args.iters)
                rec.update(us=ms * 1e3, bw_pct=100 * nbytes / (ms * 1e-3) / bw)
                if label.startswith("decode") and name != "torch" and not args.no_graph:
                    try:
                        gms = graph_time(run, args.iters)
                        rec.update(
                            graph_us=gms * 1e3, graph_bw_pct=100 * nbytes / (gms * 1e-3) / bw
                        )
                    except Exception as exc:  # a backend that cannot be captured: eager only
                        rec["graph_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            finally:
                torch.cuda.empty_cache()
            rows.append(rec)
            if jf:
                jf.write(json.dumps(rec) + "\n")
                jf.flush()
            if "us" in rec:
                graph = (
                    f" | graph {rec['graph_us']:8.1f} us {rec['graph_bw_pct']:6.1f}% HBM"
                    if "graph_us" in rec
                    else ""
                )
                print(
                    f"{fam:9s} {label:24s} {name:10s} {rec['us']:10.1f} us "
                    f"{rec['bw_pct']:6.1f}% HBM{graph}",
                    flush=True,
                )
            else:
                print(f"{fam:9s} {label:24s} {name:10s} {rec['error']}", flush=True)
    if jf:
        jf.close()
    md = markdown(rows, device, bw, [n for n in names if any(r["backend"] == n for r in rows)])
    print(md)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
