"""FP8 products of a few rows: the few-row kernel against ``torch._scaled_mm`` (GPU).

For each projection of the Llama-3.1-8B shape (q/k/v 6144 x 4096, o 4096 x
4096, gate/up 28672 x 4096, down 4096 x 14336; e4m3 weights, one scale per
output column, e4m3 rows with one scale each) and each row count, times one
product in a CUDA graph that runs it over enough weight copies to leave the
L2 cache behind, and prints microseconds per product and the weight's read
rate for :func:`backplane.kernels.fp8_few_rows.scaled_mm` and for
``torch._scaled_mm`` (cuBLAS). The row count where cuBLAS catches up sets
:data:`~backplane.kernels.fp8_few_rows.MAX_ROWS`::

    python benchmarks/fp8_few_rows.py [--rows 2,8,16,32,64,96,128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv import time_calls  # noqa: E402

from backplane.kernels import fp8_few_rows as few  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}

#: bytes of weight copies a timed graph cycles through (several times the L2 cache)
COPY_BYTES = 512 << 20


def _shape_rows(name: str, n: int, k: int, rows_list: list[int]) -> list[dict]:
    """Time both products of one ``[n, k]`` weight at each row count; print and return rows."""
    copies = max(2, COPY_BYTES // (n * k))
    ws = [
        torch.randn(n, k, device="cuda").clamp(-4, 4).to(torch.float8_e4m3fn) for _ in range(copies)
    ]
    sb = torch.rand(n, 1, device="cuda") * 1e-2
    out = []
    for m in rows_list:
        qx = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        sa = torch.rand(m, 1, device="cuda")
        row: dict = {"shape": name, "n": n, "k": k, "rows": m}

        def few_call(w: torch.Tensor, qx=qx, sa=sa) -> None:
            few.scaled_mm(qx, w, sa, sb, None, torch.bfloat16)

        def cublas_call(w: torch.Tensor, qx=qx, sa=sa) -> None:
            torch._scaled_mm(
                qx, w.t(), scale_a=sa, scale_b=sb.reshape(1, -1), out_dtype=torch.bfloat16
            )

        calls = max(40, copies)
        if few.supports(m, ws[0]):
            row["few_us"] = time_calls(few_call, ws, calls=calls, repeats=20)
        row["cublas_us"] = time_calls(cublas_call, ws, calls=calls, repeats=20)
        out.append(row)
        cells = [
            "-" if us is None else f"{us:7.1f} ({n * k / us / 1e6:4.2f})"
            for us in (row.get("few_us"), row["cublas_us"])
        ]
        print(f"{name:>8} {m:>5} {cells[0]:>16} {cells[1]:>16}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """Time both products per shape and row count; print a table, optionally write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="2,8,16,19,32,48,64,96,128", help="row counts")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument(
        "--max-rows", type=int, help="lift the kernel's row limit to this (where is the crossover)"
    )
    args = ap.parse_args(argv)
    if args.max_rows:
        few.MAX_ROWS = args.max_rows
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    rows_list = [int(r) for r in args.rows.split(",")]
    out = []
    print(f"{torch.cuda.get_device_name()}: us per product (weight read rate, TB/s)")
    print(f"{'shape':>8} {'rows':>5} {'few-row':>16} {'_scaled_mm':>16}")
    for name, (n, k) in SHAPES.items():
        out += _shape_rows(name, n, k, rows_list)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
