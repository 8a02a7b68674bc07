"""Time the models' fused elementwise functions: torch eager, torch compiled, Triton kernels.

Each function of :mod:`backplane.models.fused` runs at decode shapes (``--tokens``,
1, 8 and 64 by default) of the models it serves:

* ``rms_norm`` / ``add_rms_norm``: a 2048-wide hidden state (the ~1.1B Llama) and a
  4096-wide one;
* ``silu_and_mul``: intermediate sizes 5632 and 14336; ``relu2``: Nemotron-H's MLP;
* ``rotary``: queries and keys of a fused qkv output rotated in place (32 + 4
  heads of 64, the ~1.1B Llama; 32 + 8 heads of 128);
* ``gated_rms_norm``: Qwen3-Next's delta output (32 heads of 128) and a Mamba2
  output (8192 channels in 8 groups, gated before the norm).

Implementations: ``torch`` (the plain torch ops, eager), ``compiled`` (the same
function under ``torch.compile``, inductor) and ``triton`` (``fused_ops="triton"``:
one kernel each). On CUDA each is timed with CUDA events as the median over
``--repeats`` of ``--iters`` back-to-back calls (``eager``: launches included),
and, with ``--graphs`` (the default there), as the replay of a CUDA graph of
``--iters`` calls (GPU time only: how the engine runs decode). On the CPU only
the wall time of eager calls is measured; Triton runs there only in the
interpreter (``TRITON_INTERPRET=1``), which is for checking this script, not
for timing. ``--quick`` uses tiny widths.

Run on the GPU machine::

    python benchmarks/fused_ops.py [--tokens 1,8,64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from backplane.kernels import unavailable_reason
from backplane.models import fused

logger = logging.getLogger("fused_ops")

IMPLS = ("torch", "compiled", "triton")


@dataclass
class Case:
    """One function at one shape.

    :param op: the function's name.
    :param shape: the shape, in words.
    :param tokens: the token count.
    :param make: returns the call for an implementation (``"torch"`` or ``"triton"``).
    :param nbytes: the bytes the function must read and write at least.
    """

    op: str
    shape: str
    tokens: int
    make: Callable[[str], Callable[[], Any]]
    nbytes: int


def _rnd(*shape: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype)


def cases(tokens: list[int], quick: bool, device: torch.device, dtype: torch.dtype) -> list[Case]:
    """Build every case.

    :param tokens: token counts.
    :param quick: tiny widths (for the CPU and the interpreter).
    :param device: where the tensors live.
    :param dtype: the activations' dtype.
    :return: the cases, grouped by function.
    """
    size = torch.tensor([], dtype=dtype).element_size()
    hiddens = (96,) if quick else (2048, 4096)
    inters = (160,) if quick else (5632, 14336)
    rotaries = ((4, 2, 16),) if quick else ((32, 4, 64), (32, 8, 128))
    gated = ((4, 32, 1, True),) if quick else ((32, 128, 1, True), (64, 128, 8, False))
    out: list[Case] = []

    def rnd(*shape: int) -> torch.Tensor:
        return _rnd(*shape, device=device, dtype=dtype)

    for d in hiddens:
        for t in tokens:
            x, w = rnd(t, d), rnd(d)
            out.append(
                Case(
                    "rms_norm",
                    f"D={d}",
                    t,
                    lambda impl, x=x, w=w: lambda: fused.rms_norm(x, w, 1e-6, fused_ops=impl),
                    2 * t * d * size,
                )
            )
    for d in hiddens:
        for t in tokens:
            x, r, w = rnd(t, d), rnd(t, d), rnd(d)
            out.append(
                Case(
                    "add_rms_norm",
                    f"D={d}",
                    t,
                    lambda impl, x=x, r=r, w=w: (
                        lambda: fused.fused_add_rms_norm(x, r, w, 1e-6, fused_ops=impl)
                    ),
                    4 * t * d * size,
                )
            )
    for i in inters:
        for t in tokens:
            x = rnd(t, 2 * i)
            out.append(
                Case(
                    "silu_and_mul",
                    f"I={i}",
                    t,
                    lambda impl, x=x: lambda: fused.silu_and_mul(x, fused_ops=impl),
                    3 * t * i * size,
                )
            )
    for i in inters[:1]:
        for t in tokens:
            x = rnd(t, i)
            out.append(
                Case(
                    "relu2",
                    f"I={i}",
                    t,
                    lambda impl, x=x: lambda: fused.relu_squared(x, fused_ops=impl),
                    2 * t * i * size,
                )
            )
    for hq, hk, hd in rotaries:
        for t in tokens:
            qkv = rnd(t, (hq + 2 * hk) * hd)
            cs = rnd(t, hd)
            cos, sin = cs.unsqueeze(1).chunk(2, dim=-1)

            def make(impl: str, qkv=qkv, cos=cos, sin=sin, t=t, h=hq + hk, hd=hd):
                return lambda: fused.apply_rotary_(
                    qkv[:, : h * hd].view(t, h, hd), cos, sin, fused_ops=impl
                )

            out.append(
                Case(
                    "rotary", f"{hq}+{hk} heads x {hd}", t, make, 2 * t * (hq + hk + 1) * hd * size
                )
            )
    for heads, dim, groups, nbg in gated:
        for t in tokens:
            x, z, w = rnd(t, heads * dim), rnd(t, heads * dim), rnd(dim if nbg else heads * dim)
            if nbg:
                x, z = x.view(t, heads, dim), z.view(t, heads, dim)
            group = dim if nbg else heads * dim // groups

            def make(impl: str, x=x, z=z, w=w, group=group, nbg=nbg):
                return lambda: fused.gated_rms_norm(x, z, w, 1e-6, group, nbg, fused_ops=impl)

            desc = f"{heads}x{dim}" + ("" if nbg else f" in {groups} groups, gate first")
            out.append(Case("gated_rms_norm", desc, t, make, 3 * t * heads * dim * size))
    return out


def _cuda_eager(fn: Callable[[], Any], iters: int, repeats: int) -> float:
    """Median microseconds per call of ``iters`` back-to-back calls (CUDA events)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def _cuda_graph(fn: Callable[[], Any], iters: int, repeats: int) -> float:
    """Median microseconds per call of a CUDA graph of ``iters`` calls, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return _cuda_eager(graph.replay, 1, repeats) / iters


def _cpu(fn: Callable[[], Any], iters: int, repeats: int) -> float:
    """Median microseconds per call of ``iters`` calls (wall clock)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(times)


def measure(
    case: Case, impl: str, device: torch.device, iters: int, repeats: int, graphs: bool
) -> dict[str, float]:
    """Time one implementation of a case.

    :return: ``{"eager_us": ..., "graph_us": ...}`` (the latter on CUDA with ``graphs``).
    """
    fn = case.make("triton" if impl == "triton" else "torch")
    if impl == "compiled":
        # every case's call shares its code object with the other cases of its
        # function: start afresh so that no recompile limit sends it back to eager
        torch._dynamo.reset()
        fn = torch.compile(fn, dynamic=False)
    for _ in range(3):
        fn()
    if device.type != "cuda":
        return {"eager_us": _cpu(fn, iters, repeats)}
    torch.cuda.synchronize()
    result = {"eager_us": _cuda_eager(fn, iters, repeats)}
    if graphs:
        result["graph_us"] = _cuda_graph(fn, iters, repeats)
    return result


def _table(rows: list[dict[str, Any]], impls: list[str], metric: str) -> str:
    head = f"{'op':<15} {'shape':<28} {'T':>4}" + "".join(f" {i + ' us':>12}" for i in impls)
    if "torch" in impls and "triton" in impls:
        head += f" {'torch/triton':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        vals = [r["times"].get(i, {}).get(metric) for i in impls]
        line = f"{r['op']:<15} {r['shape']:<28} {r['tokens']:>4}"
        line += "".join(f" {v:>12.2f}" if v is not None else f" {'-':>12}" for v in vals)
        t_torch = r["times"].get("torch", {}).get(metric)
        t_triton = r["times"].get("triton", {}).get(metric)
        if "torch" in impls and "triton" in impls:
            ratio = f"{t_torch / t_triton:.2f}" if t_torch and t_triton else "-"
            line += f" {ratio:>13}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, time every case, print the tables (and write ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--tokens", default="1,8,64", help="token counts, comma-separated")
    ap.add_argument(
        "--impls",
        default=None,
        help="comma-separated subset of torch,compiled,triton (default: every one that runs "
        "here; on the CPU: torch)",
    )
    ap.add_argument("--iters", type=int, default=100, help="calls per timing")
    ap.add_argument("--repeats", type=int, default=5, help="timings per median")
    ap.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time CUDA-graph replays (default: on CUDA)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny widths (CPU, interpreter)")
    ap.add_argument("--ops", default=None, help="comma-separated subset of the functions")
    ap.add_argument("--json", metavar="FILE", help="write the measurements as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    graphs = device.type == "cuda" if args.graphs is None else args.graphs
    if graphs and device.type != "cuda":
        ap.error("--graphs needs a CUDA device")
    triton_reason = unavailable_reason(device)
    if args.impls:
        impls = [i for i in args.impls.split(",") if i]
        unknown = sorted(set(impls) - set(IMPLS))
        if unknown:
            ap.error(f"unknown implementations {unknown}; choose from {', '.join(IMPLS)}")
        if "triton" in impls and triton_reason:
            ap.error(f"triton cannot run on {device}: {triton_reason}")
    elif device.type == "cuda":
        impls = ["torch", "compiled"] + (["triton"] if triton_reason is None else [])
    else:
        impls = ["torch"] + (["triton"] if triton_reason is None else [])
    if triton_reason and "triton" not in impls:
        logger.info("triton skipped: %s", triton_reason)
    if "triton" in impls:
        fused.check_fused_ops("triton", device)

    selected = cases(tokens, args.quick, device, dtype)
    if args.ops:
        wanted = set(args.ops.split(","))
        selected = [c for c in selected if c.op in wanted]
    rows = []
    with torch.no_grad():
        for case in selected:
            times = {}
            for impl in impls:
                try:
                    times[impl] = measure(case, impl, device, args.iters, args.repeats, graphs)
                except Exception as exc:  # noqa: BLE001 - one failing case must not end the run
                    logger.warning(
                        "%s %s T=%d %s failed: %s", case.op, case.shape, case.tokens, impl, exc
                    )
            rows.append(
                {
                    "op": case.op,
                    "shape": case.shape,
                    "tokens": case.tokens,
                    "bytes": case.nbytes,
                    "times": times,
                }
            )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}, dtype: {args.dtype}, {args.iters} calls x {args.repeats} repeats")
    print("\nper call, eager (launches included):")
    print(_table(rows, impls, "eager_us"))
    if graphs:
        print("\nper call, CUDA-graph replay (GPU time):")
        print(_table(rows, impls, "graph_us"))
    if args.json:
        meta = {"device": name, "dtype": args.dtype, "iters": args.iters, "repeats": args.repeats}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
