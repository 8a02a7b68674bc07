"""The one-row kernel over repacked Q6_K (backplane.kernels.qgemv_packed_q6k), in the interpreter.

Each product multiplies one input row by random Q6_K blocks repacked with
``repack_q6k`` and compares every output element with the float64 product of
the input and ``gguf.quants.dequantize``'s matrix (numpy, independent of
backplane). The output and the split-K partial sums are filled with NaN
before the call, so an element the kernel does not write, or a partial it
sums without writing, fails. Every split launch must leave the arrival
counters at zero and give the same bits when run again.

The tolerance: products of a six-bit quant and an input are exact in float32
(the kernel's powers of two are exact too), and each output is float32 sums
of at most ``K`` terms and ``K / 16`` sub-block starts of ``-32 * sum(x)`` (a
chain of 17 per sub-block, four scaled sums a thread, a tree over a row's
threads, the split partials in order), so its error is a few hundred float32
roundings of ``sum(|x| * 95 * d * |sc|)`` at worst, under ``1e-5`` of
``sum(|x| * |w|)`` for these weights; then one rounding to the output dtype
(truncation in the interpreter: ``2 eps``).

Checks: shapes whose rows are not a multiple of a tile and whose width is
not a multiple of a chunk, a split product, an unsplit one, bfloat16
inputs, launches other than the planned one (chunks of one to four
super-blocks, prefetching 0, 1 or 2 tiles, a stage of ``cp.async``), inputs
from 1e-12 to 1e15 in size, the bit order (one-hot inputs read out each
column of a group and of its ``qh`` partner, exactly), the dequantising
kernel, the launch plan at the Llama-3.1-8B Q6_K shapes, and the refusals.

The checks run in one child process under ``TRITON_INTERPRET=1`` (see
``tests/interpreter_checks.py``); one by hand::

    TRITON_INTERPRET=1 python tests/test_qgemv_packed_q6k_interpret.py odd
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from interpreter_checks import interpreter_tests, main

ROOT = Path(__file__).resolve().parent.parent

#: name -> (rows, values per row, dtype)
PRODUCTS = {
    "odd": (37, 768, torch.float32),  # a partial row tile, a partial chunk
    "split": (24, 2048, torch.float32),  # split two ways
    "split-tail": (19, 3328, torch.float32),  # split four ways, the last chunk 1 super-block
    "single": (9, 256, torch.float32),  # one chunk: no split
    "bf16": (16, 1024, torch.bfloat16),
}
CHECKS = [*PRODUCTS, "launches", "scales", "bit-order", "dequant", "plan", "refusals"]


def _weight(rows: int, cols: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random Q6_K blocks and gguf's float64 matrix of them."""
    from packed_kernel_checks import weight

    return weight("Q6_K", rows, cols, seed)


def _product(
    blocks: np.ndarray, w: torch.Tensor, x: torch.Tensor, launch=None, what: str = ""
) -> torch.Tensor:
    """One poisoned product against the float64 reference (see
    ``tests/packed_kernel_checks.py``); returns the output row."""
    from packed_kernel_checks import product

    from backplane import kernels
    from backplane.kernels.q6k_layout import repack_q6k

    return product(kernels.load_qgemv_packed_q6k(), repack_q6k, blocks, w, x, launch, what)


def _launches() -> None:
    """Launches other than the planned one: tiles, chunks of one to four super-blocks (the
    width of five is not a multiple of two or four), warps, prefetching, a stage of
    ``cp.async``, rows per program not a multiple of the tile."""
    from backplane import kernels

    qp = kernels.load_qgemv_packed_q6k()
    blocks, w = _weight(40, 1280, 5)
    x = torch.randn(1, 1280, generator=torch.Generator().manual_seed(5))
    for launch in (
        qp.Launch(8, 256, 1, 16, 2),
        qp.Launch(16, 512, 2, 24, 2),
        qp.Launch(8, 1024, 4, 40, 2, stages=2),
        qp.Launch(4, 512, 1, 12, 2),
        qp.Launch(8, 256, 1, 10, 2),
        qp.Launch(8, 256, 1, 24, 2, prefetch=1),
        qp.Launch(8, 512, 2, 12, 2, prefetch=2),
        qp.Launch(16, 256, 2, 40, 2, prefetch=2),
        qp.Launch(2, 1024, 1, 6, 2, prefetch=1),
        qp.Launch(4, 512, 1, 10, 2, prefetch=2),
    ):
        assert launch.fills(), launch
        _product(blocks, w, x, launch, str(launch))


def _scales() -> None:
    """Inputs far from 1 (the kernel scales them by powers of two up to 2**64)."""
    blocks, w = _weight(24, 1024, 6)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(6))
    for factor in (1e-12, 1e-3, 1e6, 1e15):
        _product(blocks, w, x * factor, None, f"x * {factor:g}")


def _bit_order() -> None:
    """One-hot inputs read out a column: every position of a group (both sub-blocks), of its
    ``qh`` partner four groups on, and of a pair of the next super-block comes out exactly,
    so the kernel pairs each six-bit quant and scale with its own input."""
    from backplane import kernels
    from backplane.kernels.q6k_layout import repack_q6k

    qp = kernels.load_qgemv_packed_q6k()
    rows, cols = 16, 512
    blocks, w = _weight(rows, cols, 7)
    packed = repack_q6k(torch.from_numpy(blocks), cols)
    want = w.float()
    for k in [*range(32), *range(128, 160), *range(416, 448)]:
        x = torch.zeros(1, cols)
        x[0, k] = 1.0
        got = qp.packed_gemv(x, packed)[0]
        assert torch.equal(got, want[:, k]), (
            f"input {k}: got {got[:4].tolist()}, column {want[:4, k].tolist()}"
        )


def _dequant() -> None:
    """The dequantising kernel gives gguf's values (float32 exactly here, bfloat16 rounded)."""
    from backplane import kernels
    from backplane.kernels.q6k_layout import repack_q6k

    qp = kernels.load_qgemv_packed_q6k()
    blocks, w = _weight(21, 768, 8)
    packed = repack_q6k(torch.from_numpy(blocks), 768)
    got = qp.dequantize_packed_matrix(packed, torch.float32)
    assert got.shape == (21, 768) and got.dtype == torch.float32
    assert torch.equal(got, w.float())
    got = qp.dequantize_packed_matrix(packed, torch.bfloat16)
    err = (got.double() - w).abs()
    assert (err <= 2 * torch.finfo(torch.bfloat16).eps * w.abs()).all(), err.max()


def _plan() -> None:
    """Every Llama-3.1-8B shape Q4_K_M files store as Q6_K (the LM head, down, v) gets a
    launch with no replicated work, a few programs per multiprocessor of a
    132-multiprocessor device, and partial sums under 3% of its bytes."""
    from backplane import kernels

    qp = kernels.load_qgemv_packed_q6k()
    for n, k in [(128256, 4096), (4096, 14336), (1024, 4096), (6144, 4096)]:
        launch = qp.plan(n, k, 132)
        (row_runs, split_k), (_, rows, _), _ = qp._launch(n, k, 132)
        assert launch.fills() and launch.groups_per_thread == 2, (n, k, launch)
        assert launch.block_k % 256 == 0
        assert rows % launch.block_n == 0 and row_runs * rows >= n
        assert 4 * 132 <= row_runs * split_k <= 16 * 132, (n, k, row_runs, split_k)
        # each row writes and reads split_k float32 partials; the weight is 0.82 bytes a value
        assert split_k * 8 < 0.03 * k * 0.82, (n, k, split_k)
    # the Q4_K kernel's measured launch, the starting point
    assert tuple(qp.plan(4096, 14336, 132)) == (2, 1024, 1, 28, 2, 1, 1)
    for n, k in [(7, 256), (3, 512)]:
        assert qp.plan(n, k, 132).fills(), (n, k)


def _refusals() -> None:
    """Inputs that are not one row of the weight's width, outputs that do not fit, and
    launches the kernel cannot run."""
    from backplane import kernels
    from backplane.kernels.q6k_layout import repack_q6k

    qp = kernels.load_qgemv_packed_q6k()
    packed = repack_q6k(torch.zeros(8, 210, dtype=torch.uint8), 256)
    x = torch.zeros(1, 256)
    cases = [
        (torch.zeros(2, 256), {}, "one input row of 256"),
        (torch.zeros(1, 512), {}, "one input row of 256"),
        (torch.zeros(1, 256, dtype=torch.float64), {}, "does not run"),
        (x, {"out": torch.zeros(1, 9)}, "out must be [1, 8]"),
        (x, {"out": torch.zeros(1, 8, dtype=torch.bfloat16)}, "out must be [1, 8]"),
        (x, {"out": torch.zeros(1, 8)}, None),
        (x, {"out": torch.zeros(1, 16)[:, ::2]}, "contiguous"),
        (x, {"launch": qp.Launch(8, 256, 1, 8, 1)}, "two groups a thread"),
        (x, {"launch": qp.Launch(32, 128, 1, 32, 2)}, "whole 256-value super-blocks"),
    ]
    # rows of a bigger matrix: strided, which the kernel cannot read
    wide = repack_q6k(torch.zeros(8, 420, dtype=torch.uint8), 512)
    strided = type(wide)(*(t[:, : t.shape[1] // 2] for t in wide))
    try:
        qp.packed_gemv(x, strided)
    except ValueError as e:
        assert "contiguous" in str(e), str(e)
    else:
        raise AssertionError("no ValueError for a strided packed weight")
    try:
        qp.dequantize_packed_matrix(packed, torch.float64)
    except ValueError as e:
        assert "do not write" in str(e), str(e)
    else:
        raise AssertionError("no ValueError for a float64 matrix")
    for xi, kwargs, message in cases:
        if message is None:
            qp.packed_gemv(xi, packed, **kwargs)
            continue
        try:
            qp.packed_gemv(xi, packed, **kwargs)
        except ValueError as e:
            assert message in str(e), (message, str(e))
        else:
            raise AssertionError(f"no ValueError for {tuple(xi.shape)} {xi.dtype} {kwargs}")


def _check(name: str) -> None:
    """Run one check by name."""
    sys.path.insert(0, str(ROOT / "tests"))
    if name in PRODUCTS:
        rows, cols, dtype = PRODUCTS[name]
        blocks, w = _weight(rows, cols, rows + cols)
        x = torch.randn(1, cols, generator=torch.Generator().manual_seed(cols)).to(dtype)
        _product(blocks, w, x, None, name)
    else:
        {
            "launches": _launches,
            "scales": _scales,
            "bit-order": _bit_order,
            "dequant": _dequant,
            "plan": _plan,
            "refusals": _refusals,
        }[name]()


# -- the pytest side ------------------------------------------------------------------------

if __name__ != "__main__":
    import pytest

    pytest.importorskip("gguf")

    interpret_results, test_in_interpreter = interpreter_tests(__file__, CHECKS)


# -- the child side -------------------------------------------------------------------------

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CHECKS, _check))
