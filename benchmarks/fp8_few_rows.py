"""FP8 products of a few rows: the few-row kernel against ``torch._scaled_mm`` (GPU).

For each projection of the Llama-3.1-8B shape (q/k/v 6144 x 4096, o 4096 x
4096, gate/up 28672 x 4096, down 4096 x 14336; e4m3 weights, one scale per
output column, e4m3 rows with one scale each) and each row count, times one
product in a CUDA graph that runs it over enough weight copies to leave the
L2 cache behind, and prints microseconds per product and the weight's read
rate for :func:`backplane.kernels.fp8_few_rows.scaled_mm` and for
``torch._scaled_mm`` (cuBLAS). The row count where cuBLAS catches up sets
:data:`~backplane.kernels.fp8_few_rows.MAX_ROWS`; ``--sweep`` times every
launch of a grid (tile columns, step columns, pipeline depth, programs per
multiprocessor; past 32 rows, row blocks of 32) per shape and row count and
prints the fastest, which is what :func:`~backplane.kernels.fp8_few_rows.plan`
is chosen from (on more than one GPU kind)::

    python benchmarks/fp8_few_rows.py [--rows 2,8,16,32,64,96,128] [--json out.json]
    python benchmarks/fp8_few_rows.py --sweep full --rows 2,32,48,64 --json sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv import time_calls  # noqa: E402

from backplane.core.launch import cdiv  # noqa: E402
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


#: the grids ``--sweep`` takes: tile columns, step columns, warps, pipeline depth,
#: programs per multiprocessor
GRIDS = {
    "full": ((64, 128), (128, 256), (4,), (3, 4, 5), (1, 2, 3, 4)),
    "small": ((64,), (128, 256), (4,), (4, 5), (2, 3)),
}


def _launches(m: int, n: int, k: int, sms: int, grid: str = "full") -> list[few.Launch]:
    """The launches :func:`sweep` times for ``m`` rows of an ``[n, k]`` weight."""
    out = []
    bm = 16 if m <= 16 else 32  # past 32 rows, several row blocks of 32
    for bn, bk, warps, stages, programs in itertools.product(*GRIDS[grid]):
        if n % bn or k % bk:
            continue
        split, per = few.split_plan(n, k, sms, bn, bk, programs, cdiv(m, bm))
        out.append(few.Launch(bm, bn, bk, split, per, warps, stages))
    return list(dict.fromkeys(out))


def sweep(rows_list: list[int], grid: str = "full") -> list[dict]:
    """Time every launch of :func:`_launches` per shape and row count; print the fastest."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    few.MAX_ROWS = few.WIDE_MAX_ROWS = max(few.MAX_ROWS, *rows_list)
    out = []
    for name, (n, k) in SHAPES.items():
        copies = max(2, COPY_BYTES // (n * k))
        ws = [
            torch.randn(n, k, device="cuda").clamp(-4, 4).to(torch.float8_e4m3fn)
            for _ in range(copies)
        ]
        sb = torch.rand(n, 1, device="cuda") * 1e-2
        for m in rows_list:
            qx = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
            sa = torch.rand(m, 1, device="cuda")
            timed = []
            for launch in [None, *_launches(m, n, k, sms, grid)]:

                def call(w: torch.Tensor, launch=launch, qx=qx, sa=sa, sb=sb) -> None:
                    few.scaled_mm(qx, w, sa, sb, None, torch.bfloat16, launch)

                try:
                    us = time_calls(call, ws, calls=max(40, copies), repeats=10)
                except Exception as e:  # noqa: BLE001 - a tile too large for shared memory
                    print(f"  skip {launch}: {type(e).__name__}", flush=True)
                    continue
                timed.append((us, launch))

            def cublas_call(w: torch.Tensor, qx=qx, sa=sa, sb=sb) -> None:
                torch._scaled_mm(
                    qx, w.t(), scale_a=sa, scale_b=sb.reshape(1, -1), out_dtype=torch.bfloat16
                )

            cublas = time_calls(cublas_call, ws, calls=max(40, copies), repeats=10)
            default = next(us for us, launch in timed if launch is None)
            best = sorted((t for t in timed if t[1] is not None), key=lambda t: t[0])[:5]
            print(
                f"{name:>8} {m:>4} default {default:6.1f} cublas {cublas:6.1f} best "
                + " | ".join(f"{us:6.1f} {tuple(lz)}" for us, lz in best[:3]),
                flush=True,
            )
            out.append(
                {
                    "shape": name, "n": n, "k": k, "rows": m, "default_us": default,
                    "cublas_us": cublas,
                    "best": [{"us": us, "launch": lz._asdict()} for us, lz in best],
                    "all": [{"us": us, "launch": lz._asdict()} for us, lz in timed if lz],
                }
            )  # fmt: skip
        del ws
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    """Time both products per shape and row count; print a table, optionally write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="2,8,16,19,32,48,64,96,128", help="row counts")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument(
        "--max-rows", type=int, help="lift the kernel's row limit to this (where is the crossover)"
    )
    ap.add_argument(
        "--sweep", choices=sorted(GRIDS), help="time this grid of launches instead (see GRIDS)"
    )
    args = ap.parse_args(argv)
    if args.max_rows:
        few.MAX_ROWS = few.WIDE_MAX_ROWS = args.max_rows
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.sweep:
        print(f"{torch.cuda.get_device_name()}: us per product, fastest launches")
        out = sweep(rows_list, args.sweep)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "sweep": out}, f, indent=1)
        return 0
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
