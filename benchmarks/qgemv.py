"""The one-row GGUF kernel (:func:`backplane.kernels.qgemv.quantized_gemv`) against the read bandwidth.

For each projection of the Llama-3.1-8B shape (q/k/v merged 6144x4096, o
4096x4096, gate/up merged 28672x4096, down 4096x14336, LM head 128256x4096)
and each type the kernel reads (Q8_0, Q4_K, Q5_K, Q6_K), the kernel is timed
at one input row with the launch its ``plan`` picks: CUDA-graph replays of
back-to-back calls (after warm-up), cycling through enough copies of the
blocks that none is read from L2 (more than 256 MiB in all), median of
several replays. Each figure is printed as microseconds per call, GB/s of the
blocks read, and that rate's fraction of the device's read bandwidth
(measured here with a large float32 sum). Before timing, each result is
checked against the blocks dequantised in torch times the input.

``--sweep`` also times a grid of launches (rows per program, splits of the
reduction, warps) per shape and type, with the best one marked: the figures
``plan`` is drawn from.

Run on the GPU machine::

    python benchmarks/qgemv.py [--types Q4_K,Q6_K] [--sweep] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch
from gemv import time_calls  # benchmarks/gemv.py: a CUDA-graph replay timer

from backplane.cli.bench.latency.floor import measure_bandwidth
from backplane.kernels import qgemv
from backplane.models.gguf.dequant import dequantize

logger = logging.getLogger("qgemv")

#: ``(out, in)`` of the Llama-3.1-8B projections
SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}

#: ggml type ids by name, with the byte offsets of each block's float16 scales
TYPES: dict[str, tuple[int, tuple[int, ...]]] = {
    "Q8_0": (8, (0,)),
    "Q4_K": (12, (0, 2)),
    "Q5_K": (13, (0, 2)),
    "Q6_K": (14, (208,)),
}

#: bytes of blocks cycled through per shape, so that no call finds its blocks in L2
COLD_BYTES = 256 << 20


def random_blocks(ggml_type: int, f16_at: tuple[int, ...], n: int, k: int) -> torch.Tensor:
    """Random blocks ``[n, row bytes]`` on CUDA with finite float16 scales (0.001).

    :param ggml_type: the blocks' ggml type id.
    :param f16_at: byte offsets of each block's float16 scales.
    :param n: rows.
    :param k: values per row.
    :return: the raw ``uint8`` blocks.
    """
    block_size, type_size = qgemv.LAYOUTS[ggml_type]
    raw = torch.randint(0, 256, (n * k // block_size, type_size), dtype=torch.uint8, device="cuda")
    scale = torch.tensor([0.001], dtype=torch.float16).view(torch.uint8).cuda()
    for off in f16_at:
        raw[:, off : off + 2] = scale
    return raw.reshape(n, -1)


def check(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, k: int) -> None:
    """Compare the kernel's row with the torch-dequantised product.

    :raises AssertionError: on an element off by more than float32 sums and the
        rounding of the stored row to ``x``'s dtype allow.
    """
    got = qgemv.quantized_gemv(x, blocks, ggml_type, k).double()
    w = dequantize(blocks.reshape(-1), ggml_type, (blocks.shape[0], k)).double()
    want = x.double() @ w.T
    ulp = torch.finfo(x.dtype).eps  # a stored element is within half of it, relatively
    bound = 1e-5 * (x.double().abs() @ w.abs().T) + ulp * want.abs() + 1e-6
    err = (got - want).abs()
    del w
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}"


def sweep_launches(n: int, k: int, block_size: int) -> list[tuple[int, int, int]]:
    """The ``(block_n, split_k, num_warps)`` grid ``--sweep`` times for an ``[n, k]`` weight."""
    units = k // block_size
    out = []
    for block_n in (8, 16, 32):
        for split_k in (1, 2, 4, 8):
            if units // split_k < 2:
                continue
            for warps in (2, 4, 8):
                out.append((block_n, split_k, warps))
    return out


def main(argv: list[str] | None = None) -> int:
    """Time every shape and type; print one row each.

    :param argv: command-line arguments (default ``sys.argv[1:]``).
    :return: the exit status.
    """
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--types", default=",".join(TYPES), help="types, comma-separated")
    p.add_argument("--shapes", default=",".join(SHAPES), help="projections, comma-separated")
    p.add_argument("--sweep", action="store_true", help="also time a grid of launches")
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        logger.error("benchmarks/qgemv.py times CUDA kernels; no CUDA device here")
        return 1
    for name in args.types.split(","):
        if name not in TYPES:
            p.error(f"unknown type {name!r}; choose from {', '.join(TYPES)}")
    for name in args.shapes.split(","):
        if name not in SHAPES:
            p.error(f"unknown projection {name!r}; choose from {', '.join(SHAPES)}")
    bw = measure_bandwidth(torch.device("cuda"))["bytes_per_s"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    logger.info("%s: read bandwidth %.1f GB/s, %d SMs", torch.cuda.get_device_name(), bw / 1e9, sms)
    logger.info(
        "%-8s %-5s %8s %6s %9s %8s %7s  %s",
        "proj", "type", "MiB", "us", "floor us", "GB/s", "of bw", "launch (block_n, split)",
    )  # fmt: skip
    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for type_name in args.types.split(","):
        ggml_type, f16_at = TYPES[type_name]
        block_size, _ = qgemv.LAYOUTS[ggml_type]
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            first = random_blocks(ggml_type, f16_at, n, k)
            nbytes = first.numel()
            copies = [first] + [
                random_blocks(ggml_type, f16_at, n, k)
                for _ in range(max(1, -(-COLD_BYTES // nbytes)) - 1)
            ]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            check(x, first, ggml_type, k)
            out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)

            def call(w: torch.Tensor, launch=None, x=x, out=out, k=k, t=ggml_type) -> None:
                qgemv.quantized_gemv(x, w, t, k, out=out, launch=launch)

            us = time_calls(call, copies)
            floor_us = nbytes / bw * 1e6
            plan = qgemv.plan(n, k // block_size, qgemv._STEPS[ggml_type][0], sms)
            row = {
                "proj": shape,
                "type": type_name,
                "n": n,
                "k": k,
                "bytes": nbytes,
                "us": us,
                "floor_us": floor_us,
                "gbs": nbytes / us / 1e3,
                "fraction": floor_us / us,
                "plan": list(plan),
            }
            logger.info(
                "%-8s %-5s %8.1f %6.1f %9.1f %8.0f %6.0f%%  %s",
                shape, type_name, nbytes / 2**20, us, floor_us, row["gbs"],
                100 * row["fraction"], plan,
            )  # fmt: skip
            if args.sweep:
                sweep = []
                for launch in sweep_launches(n, k, block_size):
                    t_us = time_calls(lambda w, launch=launch: call(w, launch), copies)
                    sweep.append({"launch": list(launch), "us": t_us})
                best = min(sweep, key=lambda r: r["us"])
                for r in sweep:
                    logger.info(
                        "    %-16s %6.1f us %5.0f%%%s",
                        tuple(r["launch"]), r["us"], 100 * floor_us / r["us"],
                        "  <- best" if r is best else "",
                    )  # fmt: skip
                row["sweep"] = sweep
            results.append(row)
            del copies, first
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bw, "gpu": torch.cuda.get_device_name(), "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
