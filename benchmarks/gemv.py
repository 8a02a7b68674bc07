"""Decode-size projections: cuBLAS (``F.linear``, with cuBLAS and with cuBLASLt) against Triton GEMVs, per shape.

Two Triton kernels:

* a candidate that lives here, not in the package: it gives each program a
  few output rows and streams their weight rows in ``BLOCK_K`` chunks
  (autotuned tile sizes), the input rows broadcast against them, accumulating
  in float32. On an H200 it beat cuBLAS only for the 2048x2048 projection at
  one row (see docs/benchmarks/latency.md);
* at one row, the package's split-K kernel
  (:mod:`backplane.kernels.gemv`), with the launch its ``plan`` picks
  and over a grid of tiles and split counts (the figures ``plan`` is drawn
  from).

For each projection of the ~1.1B Llama shape (qkv 3072x2048, o 2048x2048,
gate_up 16384x2048, down 2048x8192, LM head 32000x2048; ``--model
nemotron-h-0.85b`` takes that shape's Mamba2, MLP and attention projections)
at 1 and 8 rows, both
implementations are timed as CUDA-graph replays of back-to-back calls, cycling
through enough copies of the weight that none is read from L2 (more than 256 MiB
in all), and each figure is set against the projection's own bandwidth floor
(weight bytes / the device's read bandwidth, measured here with a large
reduction). The Triton results are checked against cuBLAS's first.

With ``--fused`` it times each projection of ``--model`` at one row as a
Llama-family layer runs it, with the work that rides along (q/k/v: residual
add, RMS norm and rotary; gate/up: residual add and RMS norm, and with the
gated product as its epilogue; down: the gated activation as its prologue,
and plain), over a few launches, against the separate kernels (the norm or
activation kernel and the plain projection, or cuBLAS); with ``--fp8
channel`` as well, on FP8 weights scaled per row.

With ``--fp8 tensor|channel|block`` (alone) it times FP8 (e4m3) weights at one row
instead, scaled per tensor, per output channel or per 128x128 block: the
split-K kernel reading them one byte per element (the launch ``plan_fp8``
picks, and a grid of tiles and split counts) against what an FP8 ``Linear``
runs at one row without it (``torch._scaled_mm`` after quantising the row,
or, for block scales, the weight dequantised and cuBLAS), each as GB/s over
the bytes the kernel reads (the weight's bytes and its scales').

Run on the GPU machine::

    python benchmarks/gemv.py [--model nemotron-h-0.85b] [--rows 1,8] [--json out.json]
    python benchmarks/gemv.py --fp8 block [--model nemotron-h-0.85b] [--json out.json]
    python benchmarks/gemv.py --fused [--fp8 channel] --model llama-8b [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from backplane.cli.bench.latency.floor import measure_bandwidth
from backplane.kernels.gemv import gemv as splitk_gemv
from backplane.kernels.gemv import plan as splitk_plan
from backplane.kernels.gemv import plan_fp8
from backplane.models.linear import Linear
from backplane.models.quant.fp8 import quantize_weight, row_scales
from backplane.models.quant.projection import convert_linear

logger = logging.getLogger("gemv")

MODELS: dict[str, dict[str, tuple[int, int]]] = {
    "llama-1b": {
        "qkv": (3072, 2048),
        "o": (2048, 2048),
        "gate_up": (16384, 2048),
        "down": (2048, 8192),
        "lm_head": (32000, 2048),
    },
    "llama-8b": {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    },
    # one rank's share at tensor-parallel sizes 2 and 4: q/k/v and gate/up split by rows,
    # o and down by columns, the LM head by vocabulary rows
    "llama-8b-tp2": {
        "qkv": (3072, 4096),
        "o": (4096, 2048),
        "gate_up": (14336, 4096),
        "down": (4096, 7168),
        "lm_head": (64128, 4096),
    },
    "llama-8b-tp4": {
        "qkv": (1536, 4096),
        "o": (4096, 1024),
        "gate_up": (7168, 4096),
        "down": (4096, 3584),
        "lm_head": (32064, 4096),
    },
    # Mamba2 in_proj: z (4096) + x, B, C (4096 + 2 * 8 * 128) + dt (64 heads)
    "nemotron-h-0.85b": {
        "in_proj": (10304, 2048),
        "out_proj": (2048, 4096),
        "up": (8192, 2048),
        "down": (2048, 8192),
        "qkv": (3072, 2048),
        "lm_head": (32000, 2048),
    },
}
"""The ``(out, in)`` shapes of each model shape's projections (see ``backplane bench latency``)."""


#: (block_n, block_k) tiles the split-K kernel is also timed with, at 1..8 splits
SPLITK_TILES = ((16, 256), (32, 256), (8, 512), (16, 512))

#: (block_n, block_k) tiles the split-K kernel is timed with on FP8 weights, at 1..8 splits
#: and 4 or 8 warps (block_k over 128 skipped for block scales: a chunk takes one scale per
#: row); an FP8 tile holds half the bytes of a 16-bit one of the same shape
FP8_TILES = (
    (16, 128),
    (32, 128),
    (16, 256),
    (32, 256),
    (8, 512),
    (16, 512),
    (32, 512),
    (8, 1024),
    (16, 1024),
)

#: warps per program the FP8 tiles are timed with
FP8_WARPS = (4, 8)

#: the most input rows the kernel takes (the rows are held in registers)
MAX_ROWS = 8


def _configs() -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in (
            (4, 256, 4, 3),
            (8, 128, 4, 3),
            (8, 256, 4, 3),
            (8, 256, 8, 3),
            (16, 128, 4, 3),
            (16, 256, 8, 3),
            (4, 512, 4, 2),
            (8, 512, 8, 2),
            (2, 1024, 4, 2),
        )
    ]


@triton.autotune(configs=_configs(), key=["M", "N", "K"])
@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        w = tl.load(
            w_ptr + rn[:, None] * stride_wn + kk[None, :],
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a few rows, as :func:`torch.nn.functional.linear`.

    :param x: ``[M, K]`` with ``1 <= M <= MAX_ROWS`` and unit stride along ``K``.
    :param weight: ``[N, K]``, contiguous.
    :param bias: optional ``[N]``.
    :param out: optional ``[M, N]`` result buffer (unit stride along ``N``).
    :return: ``[M, N]`` in ``x``'s dtype (``out`` when given).
    """
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS or weight.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"gemv takes x [1..{MAX_ROWS}, K] (unit stride) and W [N, K]")
    if not weight.is_contiguous():
        raise ValueError("gemv needs a contiguous weight")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(n, meta["BLOCK_N"]),)

    _gemv_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=triton.next_power_of_2(m),
    )
    return out


def time_calls(fn, weights: list[torch.Tensor], calls: int = 40, repeats: int = 5) -> float:
    """Median microseconds per call of ``fn(w)`` replayed in a CUDA graph over ``weights``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:3]:
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print one row per shape and row count."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,8", help="input rows (1..8), comma-separated")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--model", choices=sorted(MODELS), default="llama-1b", help="projection shapes")
    p.add_argument(
        "--fp8",
        choices=("tensor", "channel", "block"),
        help="time FP8 weights of this scale granularity at one row (see above)",
    )
    p.add_argument(
        "--fused",
        action="store_true",
        help="time the projections with their prologues and epilogues (see above)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        logger.error("needs a CUDA device")
        return 2
    bw = measure_bandwidth(torch.device("cuda"))["bytes_per_s"]
    logger.info("read bandwidth %.1f GB/s, %s", bw / 1e9, torch.cuda.get_device_name())
    if args.fused:
        return run_fused(args.model, args.fp8, bw, args.json)
    if args.fp8:
        return run_fp8(args.model, args.fp8, bw, args.json)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    logger.info(
        "%-8s %4s %9s %9s %7s %9s %7s %7s %8s",
        "shape",
        "rows",
        "floor us",
        "cublas",
        "%bw",
        "cublasLt",
        "%bw",
        "triton",
        "%bw",
    )
    for name, (n, k) in MODELS[args.model].items():
        nbytes = n * k * 2
        copies = max(2, -(-(256 << 20) // nbytes))
        weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)
        ]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, weights[0]).float()
            got = gemv(x, weights[0]).float()
            err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
            if err > 2e-2:
                logger.error("%s rows %d: Triton differs from cuBLAS by %.3g", name, m, err)
                return 1
            floor = nbytes / bw * 1e6
            t_cublas = time_calls(lambda w, x=x: F.linear(x, w), weights)
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                lt_err = (F.linear(x, weights[0]).float() - want).abs().max().item()
                t_lt = time_calls(lambda w, x=x: F.linear(x, w), weights)
            finally:
                torch.backends.cuda.preferred_blas_library("cublas")
            t_triton = time_calls(lambda w, x=x: gemv(x, w), weights)
            splitk: dict[str, float] = {}
            if m == 1:
                sk_err = (splitk_gemv(x, weights[0]).float() - want).abs().max().item()
                if sk_err / max(want.abs().max().item(), 1e-6) > 2e-2:
                    logger.error("%s: the split-K kernel differs from cuBLAS by %.3g", name, sk_err)
                    return 1
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                planned = splitk_plan(n, k, sms)
                launches = {(bn, bk, sk) for bn, bk in SPLITK_TILES for sk in (1, 2, 4, 8)}
                for launch in sorted(launches | ({planned} if planned else set())):
                    splitk[str(launch)] = time_calls(
                        lambda w, x=x, launch=launch: splitk_gemv(x, w, launch=launch), weights
                    )
                # where the plan leaves the weight to cuBLAS, the model runs cuBLAS
                splitk["plan"] = splitk[str(planned)] if planned else t_cublas
            results.append(
                {
                    "shape": name,
                    "n": n,
                    "k": k,
                    "rows": m,
                    "floor_us": floor,
                    "cublas_us": t_cublas,
                    "cublaslt_us": t_lt,
                    "cublaslt_max_abs_diff": lt_err,
                    "triton_us": t_triton,
                    "splitk_us": splitk,
                }
            )
            logger.info(
                "%-8s %4d %9.2f %9.2f %6.0f%% %9.2f %6.0f%% %7.2f %6.0f%%",
                name,
                m,
                floor,
                t_cublas,
                100 * floor / t_cublas,
                t_lt,
                100 * floor / t_lt,
                t_triton,
                100 * floor / t_triton,
            )
            if splitk:
                best = min((v, key) for key, v in splitk.items())
                logger.info(
                    "%-8s split-K: planned %s %.2f us (%.0f%%), best %.2f us (%.0f%%) at %s",
                    name,
                    planned or "(cuBLAS)",
                    splitk["plan"],
                    100 * floor / splitk["plan"],
                    best[0],
                    100 * floor / best[0],
                    best[1],
                )
        del weights
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"bandwidth": bw, "gpu": torch.cuda.get_device_name(), "results": results},
                f,
                indent=1,
            )
    return 0


def _fp8_linear(n: int, k: int, granularity: str) -> Linear:
    """A bfloat16-activation FP8 ``Linear`` ``[n, k]`` of random weights, scaled as asked."""
    w = torch.randn(n, k, device="cuda") * 0.02
    q, scale = quantize_weight(w, granularity)
    lin = Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        convert_linear(lin, 128 if granularity == "block" else None)
        lin.weight.copy_(q)
        lin.weight_scale.copy_(row_scales(scale, n, k, granularity, (128, 128)))
    # The scales as the kernel reads them: the checkpoint's (one per tensor, row or block).
    lin.kernel_scale = scale.reshape(()) if granularity == "tensor" else scale
    return lin


def run_fp8(model: str, granularity: str, bw: float, json_path: str | None) -> int:
    """Time one-row FP8 projections of ``model``'s shapes; print one row per shape.

    :param model: a key of :data:`MODELS`.
    :param granularity: ``"tensor"``, ``"channel"`` or ``"block"`` (128x128).
    :param bw: the device's read bandwidth, bytes per second.
    :param json_path: write the figures here, or ``None``.
    :return: the exit status (1 when the kernel disagrees with the other path).
    """
    block = granularity == "block"
    blocks = {"scale_k": 128, "scale_n": 128} if block else {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    logger.info(
        "%-8s %9s %9s %7s %9s %7s %9s %7s  %s",
        "shape", "floor us", "fp8 path", "GB/s", "planned", "GB/s", "best", "GB/s", "best launch",
    )  # fmt: skip
    for name, (n, k) in MODELS[model].items():
        copies = max(2, -(-(256 << 20) // (n * k)))
        lins = [_fp8_linear(n, k, granularity) for _ in range(copies)]
        scale_bytes = lins[0].kernel_scale.numel() * 4
        nbytes = n * k + scale_bytes
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

        def kernel(lin: Linear, launch: tuple[int, int, int], x: torch.Tensor = x) -> torch.Tensor:
            return splitk_gemv(x, lin.weight, scale=lin.kernel_scale, launch=launch, **blocks)

        planned = plan_fp8(n, k, sms, 128 if block else None)
        with torch.inference_mode():
            want = lins[0](x).float()  # fused_ops "torch": the path without the kernel
            got = kernel(lins[0], planned).float()
            err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
            # _scaled_mm also rounds the row to e4m3: a few per cent apart.
            if err > 0.1:
                logger.error("%s: the kernel differs from the FP8 Linear by %.3g", name, err)
                return 1
            t_path = time_calls(lambda lin, x=x: lin(x), lins)
            launches = {
                (bn, bk, sk, nw)
                for bn, bk in FP8_TILES
                for sk in (1, 2, 4, 8)
                for nw in FP8_WARPS
                if not (block and bk % 128)
            }
            times = {
                str(launch): time_calls(lambda lin, launch=launch: kernel(lin, launch), lins)
                for launch in sorted(launches | {planned})
            }
        floor = nbytes / bw * 1e6
        best_us, best_launch = min((v, key) for key, v in times.items())

        def gbs(us: float, nbytes: int = nbytes) -> float:
            return nbytes / us / 1e3

        results.append(
            {
                "shape": name,
                "n": n,
                "k": k,
                "granularity": granularity,
                "bytes": nbytes,
                "floor_us": floor,
                "fp8_path_us": t_path,
                "planned": list(planned),
                "splitk_us": times,
            }
        )
        logger.info(
            "%-8s %9.2f %9.2f %7.0f %9.2f %7.0f %9.2f %7.0f  %s",
            name,
            floor,
            t_path,
            gbs(t_path),
            times[str(planned)],
            gbs(times[str(planned)]),
            best_us,
            gbs(best_us),
            best_launch,
        )
        del lins
        torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {
                    "bandwidth": bw,
                    "gpu": torch.cuda.get_device_name(),
                    "fp8": granularity,
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0


#: launches ``--fused`` times per projection kind, for 16-bit and FP8 weights
FUSED_LAUNCHES: dict[str, tuple[tuple[int, ...], ...]] = {
    "wide": ((16, 512, 1), (8, 512, 1), (16, 256, 1), (32, 256, 1), (16, 512, 1, 8)),
    "tall": ((16, 512, 2), (16, 256, 2), (16, 512, 4), (8, 512, 2), (16, 256, 4)),
    "wide_fp8": ((8, 1024, 1), (16, 512, 1, 8), (16, 512, 1), (8, 512, 1), (16, 256, 1)),
    "tall_fp8": ((8, 1024, 1), (16, 512, 2, 8), (8, 1024, 2), (16, 512, 2), (16, 256, 2)),
}


def run_fused(model: str, fp8: str | None, bw: float, json_path: str | None) -> int:
    """Time ``model``'s projections as a layer runs them at one row; print one row per launch.

    :param model: a key of :data:`MODELS` with ``qkv``, ``o``, ``gate_up`` and ``down``.
    :param fp8: ``"channel"`` for FP8 weights scaled per row, ``None`` for bfloat16.
    :param bw: the device's read bandwidth, bytes per second.
    :param json_path: write the figures here, or ``None``.
    :return: the exit status (1 when a fused launch disagrees with the separate kernels).
    """
    if fp8 not in (None, "channel"):
        logger.error("--fused takes --fp8 channel or none")
        return 2
    shapes = MODELS[model]
    results = []
    logger.info("%-8s %-10s %9s %9s %7s  %s", "shape", "variant", "floor us", "us", "%bw", "launch")
    for name, variant in (
        ("qkv", "norm_rope"),
        ("o", "plain"),
        ("gate_up", "norm"),
        ("gate_up", "norm_glu"),
        ("down", "gated"),
        ("down", "plain"),
    ):
        n, k = shapes[name]
        floor = (n * k * (1 if fp8 else 2) + (n * 4 if fp8 else 0)) / bw * 1e6
        rows = _fused_rows(shapes, name, variant, fp8 is not None)
        if rows is None:
            return 1
        for key, us in rows.items():
            logger.info(
                "%-8s %-10s %9.2f %9.2f %6.0f%%  %s",
                name,
                variant,
                floor,
                us,
                100 * floor / us,
                key,
            )
        results.append(
            {"shape": name, "variant": variant, "n": n, "k": k, "floor_us": floor, "us": rows}
        )
        torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            out = {"bandwidth": bw, "gpu": torch.cuda.get_device_name(), "fp8": fp8}
            json.dump({**out, "results": results}, f, indent=1)
    return 0


def _fused_rows(
    shapes: dict[str, tuple[int, int]], name: str, variant: str, fp8: bool
) -> dict[str, float] | None:
    """Microseconds per call of one projection's fused and separate launches (``None``: a
    fused launch disagreed with the separate kernels)."""
    from backplane.kernels import elementwise
    from backplane.kernels.gemv import OneRowProjection

    n, k = shapes[name]
    head_dim, q_rows = 128, shapes["o"][1]
    kv_rows = (shapes["qkv"][0] - q_rows) // 2
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    copies = max(2, -(-(256 << 20) // (n * k * (1 if fp8 else 2))))
    weights, scales = [], []
    for _ in range(copies):
        w = torch.randn(n, k, device=dev) * 0.02
        if fp8:
            q, scale = quantize_weight(w, "channel")
            weights.append(q)
            scales.append(scale.reshape(-1).contiguous())
        else:
            weights.append(w.to(bf16))
    x = torch.randn(1, 2 * k if variant == "gated" else k, device=dev, dtype=bf16)
    residual = torch.randn(1, k, device=dev, dtype=bf16)
    g = (torch.rand(k, device=dev) + 0.5).to(bf16)
    cos = torch.rand(head_dim // 2, device=dev).to(bf16)
    sin = torch.rand(head_dim // 2, device=dev).to(bf16)
    normed = variant.startswith("norm")
    extras: dict = {}
    if normed:
        extras["norm"] = (g, 1e-5, False)
    if variant == "norm_rope":
        extras["rotary"] = (q_rows + kv_rows, head_dim // 2)
    if variant == "gated":
        extras["gate_act"] = "silu"
    if variant == "norm_glu":
        extras["glu"] = "silu"

    def project(i: int, launch: tuple[int, ...], **kw) -> OneRowProjection:
        scale = {"scale": scales[i], "dtype": bf16} if fp8 else {}
        return OneRowProjection(weights[i], launch=launch, **scale, **kw)

    def prologue() -> torch.Tensor:
        if normed:
            return elementwise.add_rms_norm(x, residual, g, 1e-5, False)[0]
        return elementwise.act_and_mul(x, "silu") if variant == "gated" else x

    def call_fused(proj: OneRowProjection) -> torch.Tensor:
        return proj(x, residual, cos, sin)[0] if normed else proj(x)[0]

    def call_separate(proj: OneRowProjection) -> torch.Tensor:
        y = proj(prologue())[0]
        return elementwise.act_and_mul(y, "silu") if variant == "norm_glu" else y

    def call_cublas(w: torch.Tensor) -> torch.Tensor:
        return F.linear(prologue(), w)

    kind = ("tall" if k >= 2 * n else "wide") + ("_fp8" if fp8 else "")
    rows: dict[str, float] = {}
    with torch.inference_mode():
        for launch in FUSED_LAUNCHES[kind]:
            try:
                projs = [project(i, launch, **extras) for i in range(copies)]
            except ValueError as exc:  # a rotary epilogue the launch cannot hold
                logger.info("%-8s %-10s skipped %s: %s", name, variant, launch, exc)
                continue
            plain = [project(i, launch) for i in range(copies)]
            if variant != "norm_rope":  # the rotation is left out of the separate pair
                got, want = call_fused(projs[0]).float(), call_separate(plain[0]).float()
                err = (got - want).abs().max().item()
                if err > 1e-2 * max(want.abs().max().item(), 1e-6):
                    logger.error("%s %s %s: fused differs by %.3g", name, variant, launch, err)
                    return None
            rows[f"fused {launch}"] = time_calls(call_fused, projs)
            if variant != "plain":
                rows[f"separate {launch}"] = time_calls(call_separate, plain)
        if not fp8 and variant != "plain":
            rows["separate cuBLAS"] = time_calls(call_cublas, weights)
    return rows


if __name__ == "__main__":
    sys.exit(main())
