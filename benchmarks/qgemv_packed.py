"""Q4_K and Q6_K at one input row: ggml's blocks (:mod:`backplane.kernels.qgemv`) against the
repacked layouts (:mod:`backplane.kernels.qgemv_packed`, :mod:`backplane.kernels.qgemv_packed_q6k`),
side by side, per Llama-3.1-8B projection.

For each projection (q/k/v merged 6144x4096, o 4096x4096, gate/up merged
28672x4096, down 4096x14336) random Q4_K blocks are made on the GPU and
repacked with :func:`~backplane.kernels.q4k_layout.repack_q4k`. Both kernels
are checked against the float64 product of the input and the blocks
dequantised in torch, then timed at one bfloat16 row with the launch their
``plan`` picks: CUDA-graph replays of back-to-back calls (after warm-up),
cycling through enough copies of the weight that none is read from L2 (more
than 256 MiB in all), median of several replays. Each figure is printed as
microseconds per call, GB/s of the Q4_K weight (``rows * K / 256 * 144``
bytes, for both kernels: the packed layout reads 2.8% more) and that rate's
fraction of the device's read bandwidth (measured here with a large float32
sum); the last line adds the four projections up for the 32 layers of the
8B model.

The Q6_K shapes (``lm_head_q6k`` 128256x4096, the LM head of a Q4_K_M file;
``down_q6k`` 4096x14336, the down projection of half its layers) are timed the
same way, random Q6_K blocks repacked with
:func:`~backplane.kernels.q6k_layout.repack_q6k` (the same bytes as the blocks),
rates counted against the Q6_K weight; the sweep tries only launches of two
groups a thread (the Q6_K kernel's only kind). A last line adds them up per
token (the LM head once, the down projection in 16 layers).

``--sweep`` also times the packed kernel over a grid of launches (rows per
iteration, inputs per program, warps, groups per thread, prefetch stages,
row tiles prefetched into registers, each at 8, 16 and 32 programs per multiprocessor),
each checked against the reference first, and prints the best per projection:
the figures its ``plan`` should be drawn from. About 20 kernel compiles; a
minute or two on an H200 with an empty Triton cache.

Run on the GPU machine::

    python benchmarks/qgemv_packed.py --sweep [--shapes qkv,o] [--json out.json]
    python benchmarks/qgemv_packed.py --sweep --shapes lm_head_q6k,down_q6k
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch
from gemv import time_calls  # benchmarks/gemv.py: a CUDA-graph replay timer
from qgemv import COLD_BYTES, random_blocks  # benchmarks/qgemv.py

from backplane.cli.bench.latency.floor import measure_bandwidth
from backplane.core.launch import cdiv
from backplane.kernels import qgemv, qgemv_packed, qgemv_packed_q6k
from backplane.kernels.q4k_layout import repack_q4k
from backplane.kernels.q6k_layout import repack_q6k
from backplane.models.gguf.dequant import dequantize

logger = logging.getLogger("qgemv_packed")

#: ``(out, in)`` of the Llama-3.1-8B projections kept as Q4_K
SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
#: ``(out, in)`` of the 8B weights a Q4_K_M file stores as Q6_K: the LM head, and the
#: down projection of half the layers
Q6K_SHAPES: dict[str, tuple[int, int]] = {
    "lm_head_q6k": (128256, 4096),
    "down_q6k": (4096, 14336),
}
#: layers of the 8B model (each runs the four projections once per token)
LAYERS = 32
#: layers whose down projection a Q4_K_M file of the 8B model stores as Q6_K
Q6K_DOWN_LAYERS = 16

#: Q4_K's ggml type id and the byte offsets of each block's float16 scales
Q4_K = 12
Q4_K_F16_AT = (0, 2)
#: Q6_K's
Q6_K = 14
Q6_K_F16_AT = (208,)

#: ``(block_n, block_k, num_warps, groups_per_thread, stages, prefetch)`` of the packed
#: kernel ``--sweep`` times (each compiled once per width)
SWEEP: tuple[tuple[int, int, int, int, int, int], ...] = (
    (8, 512, 2, 1, 1, 0),
    (4, 512, 1, 1, 1, 1),
    (2, 1024, 1, 2, 1, 1),
    (2, 512, 1, 1, 1, 2),
    (4, 512, 1, 1, 1, 2),
    (2, 1024, 1, 2, 1, 2),
    (4, 1024, 1, 2, 1, 2),
)
#: the launches of the Q6_K kernel ``--sweep`` times: the Q4_K sweep's of two groups a
#: thread, and smaller chunks (a Q6_K row tile is 1.42x the bytes of a Q4_K one)
SWEEP_Q6K: tuple[tuple[int, int, int, int, int, int], ...] = (
    *(t for t in SWEEP if t[3] == 2),
    (4, 512, 1, 2, 1, 1),
    (4, 512, 1, 2, 1, 2),
    (8, 256, 1, 2, 1, 1),
)
#: programs per multiprocessor each sweep launch is tried at
DENSITIES = (8, 16, 32)


class Kind(NamedTuple):
    """A quantisation type the script times: its blocks, its repacking and its packed kernel.

    :param ggml_type: the type id.
    :param f16_at: byte offsets of each block's float16 scales.
    :param repack: ``(blocks, in_features) -> packed weight``.
    :param kernel: the packed kernel's module (``packed_gemv``, ``plan``).
    :param sweep: the launches ``--sweep`` times, as :data:`SWEEP`.
    """

    ggml_type: int
    f16_at: tuple[int, ...]
    repack: Callable
    kernel: ModuleType
    sweep: tuple[tuple[int, int, int, int, int, int], ...]


#: the types timed, by name
KINDS = {
    "Q4_K": Kind(Q4_K, Q4_K_F16_AT, repack_q4k, qgemv_packed, SWEEP),
    "Q6_K": Kind(Q6_K, Q6_K_F16_AT, repack_q6k, qgemv_packed_q6k, SWEEP_Q6K),
}
#: every shape: its type's name and ``(out, in)``
ALL_SHAPES: dict[str, tuple[str, tuple[int, int]]] = {
    **{name: ("Q4_K", shape) for name, shape in SHAPES.items()},
    **{name: ("Q6_K", shape) for name, shape in Q6K_SHAPES.items()},
}


def launch_at(
    n: int, k: int, sms: int, tile: tuple[int, int, int, int, int, int], per_sm: int
) -> qgemv_packed.Launch:
    """The packed kernel's launch of ``tile`` with about ``per_sm`` programs per multiprocessor.

    :param n: output rows.
    :param k: values per row.
    :param sms: the device's multiprocessor count.
    :param tile: ``(block_n, block_k, num_warps, groups_per_thread, stages, prefetch)``.
    :param per_sm: programs per multiprocessor to aim for.
    :return: the launch (rows per program a multiple of ``block_n``).
    """
    block_n, block_k, warps, groups, stages, prefetch = tile
    runs = max(1, per_sm * sms // cdiv(k, block_k))
    rows = cdiv(cdiv(n, runs), block_n) * block_n
    return qgemv_packed.Launch(block_n, block_k, warps, rows, groups, stages, prefetch)


def reference(
    x: torch.Tensor, blocks: torch.Tensor, k: int, ggml_type: int = Q4_K
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product of ``x`` and the blocks (of ``ggml_type``) dequantised in torch, and
    the bound an output may be off by (float32 sums, one rounding to ``x``'s dtype)."""
    w = dequantize(blocks.reshape(-1), ggml_type, (blocks.shape[0], k)).double()
    xd = x.double()
    want = xd @ w.T
    bound = 1e-5 * (xd.abs() @ w.abs().T) + torch.finfo(x.dtype).eps * want.abs() + 1e-6
    return want, bound


def check(got: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    """Raise AssertionError where ``got`` is off the reference by more than its bound."""
    err = (got.double() - want[0]).abs()
    bad = ~(err <= want[1])
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} wrong elements, max {err.max():.3g}"


def main(argv: list[str] | None = None) -> int:
    """Time both kernels at every shape; print one row each (and the sweep's best).

    :param argv: command-line arguments (default ``sys.argv[1:]``).
    :return: the exit status.
    """
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default=",".join(ALL_SHAPES), help="projections, comma-separated")
    p.add_argument("--sweep", action="store_true", help="also time a grid of packed launches")
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        logger.error("benchmarks/qgemv_packed.py times CUDA kernels; no CUDA device here")
        return 1
    for name in args.shapes.split(","):
        if name not in ALL_SHAPES:
            p.error(f"unknown projection {name!r}; choose from {', '.join(ALL_SHAPES)}")
    started = time.perf_counter()
    device = torch.device("cuda")
    bw = measure_bandwidth(device)["bytes_per_s"]
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    logger.info("%s: read bandwidth %.1f GB/s, %d SMs", torch.cuda.get_device_name(), bw / 1e9, sms)
    logger.info(
        "%-11s %7s %8s | %8s %7s %6s | %8s %7s %6s %7s | %s",
        "proj", "MiB", "floor us", "blocks us", "GB/s", "of bw",
        "packed us", "GB/s", "of bw", "speedup", "packed plan",
    )  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(0)
    results = []
    for shape in args.shapes.split(","):
        type_name, (n, k) = ALL_SHAPES[shape]
        kind = KINDS[type_name]
        first = random_blocks(kind.ggml_type, kind.f16_at, n, k)
        nbytes = first.numel()  # the raw weight: what both rates are counted against
        copies = [first] + [
            random_blocks(kind.ggml_type, kind.f16_at, n, k)
            for _ in range(max(1, -(-COLD_BYTES // nbytes)) - 1)
        ]
        packed = [kind.repack(c, k) for c in copies]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16, generator=gen)
        out = torch.empty(1, n, device=device, dtype=torch.bfloat16)
        want = reference(x, first, k, kind.ggml_type)
        check(qgemv.quantized_gemv(x, first, kind.ggml_type, k), want, f"{shape} blocks")
        check(kind.kernel.packed_gemv(x, packed[0]), want, f"{shape} packed")

        def raw_call(w: torch.Tensor, x=x, out=out, k=k, t=kind.ggml_type) -> None:
            qgemv.quantized_gemv(x, w, t, k, out=out)

        def packed_call(w, launch=None, x=x, out=out, kernel=kind.kernel) -> None:
            kernel.packed_gemv(x, w, out=out, launch=launch)

        raw_us = time_calls(raw_call, copies)
        packed_us = time_calls(packed_call, packed)
        floor_us = nbytes / bw * 1e6
        plan = kind.kernel.plan(n, k, sms)
        row = {
            "proj": shape,
            "type": type_name,
            "n": n,
            "k": k,
            "bytes": nbytes,
            "packed_bytes": packed[0].nbytes(),
            "floor_us": floor_us,
            "blocks_us": raw_us,
            "packed_us": packed_us,
            "plan": list(plan),
        }
        logger.info(
            "%-11s %7.1f %8.1f | %8.1f %7.0f %5.0f%% | %8.1f %7.0f %5.0f%% %6.2fx | %s",
            shape, nbytes / 2**20, floor_us, raw_us, nbytes / raw_us / 1e3,
            100 * floor_us / raw_us, packed_us, nbytes / packed_us / 1e3,
            100 * floor_us / packed_us, raw_us / packed_us, tuple(plan),
        )  # fmt: skip
        if args.sweep:
            sweep = []
            for tile in kind.sweep:
                for per_sm in DENSITIES:
                    launch = launch_at(n, k, sms, tile, per_sm)
                    if not launch.fills():
                        continue
                    got = kind.kernel.packed_gemv(x, packed[0], launch=launch)
                    check(got, want, str(launch))
                    t_us = time_calls(lambda w, launch=launch: packed_call(w, launch), packed)
                    sweep.append({"launch": list(launch), "per_sm": per_sm, "us": t_us})
            best = min(sweep, key=lambda r: r["us"])
            for r in sorted(sweep, key=lambda r: r["us"])[:5]:
                logger.info(
                    "    %-42s %3d/SM %7.1f us %7.0f GB/s %5.0f%%%s",
                    str(tuple(r["launch"])), r["per_sm"], r["us"], nbytes / r["us"] / 1e3,
                    100 * floor_us / r["us"], "  <- best" if r is best else "",
                )  # fmt: skip
            row["sweep"] = sweep
            row["best"] = best
        results.append(row)
        del copies, packed, first, want
        torch.cuda.empty_cache()
    q4k = [r for r in results if r["proj"] in SHAPES]
    if {r["proj"] for r in q4k} == set(SHAPES):
        total = {
            key: LAYERS * sum(r[key] for r in q4k) / 1e3
            for key in ("floor_us", "blocks_us", "packed_us")
        }
        best = LAYERS * sum(r["best"]["us"] for r in q4k) / 1e3 if args.sweep else None
        logger.info(
            "8B Q4_K projections per token (%d layers): floor %.3f ms, blocks %.3f ms (%.2fx), "
            "packed %.3f ms (%.2fx)%s",
            LAYERS, total["floor_us"], total["blocks_us"], total["blocks_us"] / total["floor_us"],
            total["packed_us"], total["packed_us"] / total["floor_us"],
            f", best sweep launches {best:.3f} ms ({best / total['floor_us']:.2f}x)" if best else "",
        )  # fmt: skip
    q6k = {r["proj"]: r for r in results if r["proj"] in Q6K_SHAPES}
    if set(q6k) == set(Q6K_SHAPES):
        # the LM head once a token, the Q6_K down projections in half the layers
        times = {"lm_head_q6k": 1, "down_q6k": Q6K_DOWN_LAYERS}
        total = {
            key: sum(times[p] * r[key] for p, r in q6k.items()) / 1e3
            for key in ("floor_us", "blocks_us", "packed_us")
        }
        logger.info(
            "8B Q4_K_M Q6_K weights per token (LM head, %d down): floor %.3f ms, blocks %.3f ms "
            "(%.2fx), packed %.3f ms (%.2fx)",
            Q6K_DOWN_LAYERS, total["floor_us"], total["blocks_us"],
            total["blocks_us"] / total["floor_us"], total["packed_us"],
            total["packed_us"] / total["floor_us"],
        )  # fmt: skip
    logger.info("done in %.0f s", time.perf_counter() - started)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bw, "gpu": torch.cuda.get_device_name(), "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
