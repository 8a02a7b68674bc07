"""The one-row kernel over repacked Q4_K (backplane.kernels.qgemv_packed), in the interpreter.

Each product multiplies one input row by random Q4_K blocks repacked with
``repack_q4k`` and compares every output element with the float64 product of
the input and ``gguf.quants.dequantize``'s matrix (numpy, independent of
backplane). The output and the split-K partial sums are filled with NaN
before the call, so an element the kernel does not write, or a partial it
sums without writing, fails. Every split launch must leave the arrival
counters at zero and give the same bits when run again.

The tolerance: products of a nibble and an input are exact in float32 (the
kernel's powers of two are exact too), and each output is float32 sums of
at most ``K`` terms (a chain of 32 per group, a tree over a row's threads,
the split partials in order), so its error is a few hundred float32
roundings of ``sum(|x| * |w|)`` at worst, under ``1e-5`` of it; then one
rounding to the output dtype (truncation in the interpreter: ``2 eps``).

Checks: shapes whose rows are not a multiple of a tile and whose width is
not a multiple of a chunk, a split product, an unsplit one, bfloat16
inputs, launches other than the planned one (one or two groups a thread,
prefetching), inputs from 1e-12 to 1e15 in size, the nibble order (one-hot
inputs read out each column of a group, exactly), the dequantising kernel,
the launch plan at the Llama-3.1-8B shapes, and the refusals.

The checks run in one child process under ``TRITON_INTERPRET=1`` (see
``tests/interpreter_checks.py``); one by hand::

    TRITON_INTERPRET=1 python tests/test_qgemv_packed_interpret.py odd
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
    "split": (24, 2048, torch.float32),  # split four ways
    "single": (9, 256, torch.float32),  # one chunk: no split
    "bf16": (16, 1024, torch.bfloat16),
}
CHECKS = [*PRODUCTS, "launches", "scales", "nibble-order", "dequant", "plan", "refusals"]


def _weight(rows: int, cols: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random Q4_K blocks and gguf's float64 matrix of them."""
    from packed_kernel_checks import weight

    return weight("Q4_K", rows, cols, seed)


def _product(
    blocks: np.ndarray, w: torch.Tensor, x: torch.Tensor, launch=None, what: str = ""
) -> torch.Tensor:
    """One poisoned product against the float64 reference (see
    ``tests/packed_kernel_checks.py``); returns the output row."""
    from packed_kernel_checks import product

    from backplane import kernels
    from backplane.kernels.q4k_layout import repack_q4k

    return product(kernels.load_qgemv_packed(), repack_q4k, blocks, w, x, launch, what)


def _launches() -> None:
    """Launches other than the planned one: tiles, chunks, warps, one or two groups a thread,
    prefetching, rows per program not a multiple of the tile."""
    from backplane import kernels

    qp = kernels.load_qgemv_packed()
    blocks, w = _weight(40, 1024, 5)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(5))
    for launch in (
        qp.Launch(8, 256, 1, 16, 1),
        qp.Launch(16, 512, 2, 24, 2),
        qp.Launch(8, 1024, 4, 40, 2, stages=2),
        qp.Launch(4, 512, 1, 12, 2),
        qp.Launch(32, 64, 1, 32, 2),
        qp.Launch(8, 256, 1, 24, 1, prefetch=1),
        qp.Launch(8, 512, 2, 12, 2, prefetch=2),
        qp.Launch(16, 256, 2, 40, 1, prefetch=2),
        qp.Launch(2, 1024, 1, 6, 2, prefetch=1),
        qp.Launch(2, 512, 1, 10, 1, prefetch=2),
    ):
        assert launch.fills(), launch
        _product(blocks, w, x, launch, str(launch))


def _scales() -> None:
    """Inputs far from 1 (the kernel scales them by powers of two up to 2**64)."""
    blocks, w = _weight(24, 1024, 6)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(6))
    for factor in (1e-12, 1e-3, 1e6, 1e15):
        _product(blocks, w, x * factor, None, f"x * {factor:g}")


def _nibble_order() -> None:
    """One-hot inputs read out a column: every position of the first and of a later group
    comes out exactly, so the kernel pairs each nibble with its own input."""
    from backplane import kernels
    from backplane.kernels.q4k_layout import repack_q4k

    qp = kernels.load_qgemv_packed()
    rows, cols = 16, 512
    blocks, w = _weight(rows, cols, 7)
    packed = repack_q4k(torch.from_numpy(blocks), cols)
    want = w.float()
    for k in [*range(32), *range(416, 448)]:
        x = torch.zeros(1, cols)
        x[0, k] = 1.0
        got = qp.packed_gemv(x, packed)[0]
        assert torch.equal(got, want[:, k]), (
            f"input {k}: got {got[:4].tolist()}, column {want[:4, k].tolist()}"
        )


def _dequant() -> None:
    """The dequantising kernel gives gguf's values (float32 exactly here, bfloat16 rounded)."""
    from backplane import kernels
    from backplane.kernels.q4k_layout import repack_q4k

    qp = kernels.load_qgemv_packed()
    blocks, w = _weight(21, 768, 8)
    packed = repack_q4k(torch.from_numpy(blocks), 768)
    got = qp.dequantize_packed_matrix(packed, torch.float32)
    assert got.shape == (21, 768) and got.dtype == torch.float32
    assert torch.equal(got, w.float())
    got = qp.dequantize_packed_matrix(packed, torch.bfloat16)
    err = (got.double() - w).abs()
    assert (err <= 2 * torch.finfo(torch.bfloat16).eps * w.abs()).all(), err.max()


def _plan() -> None:
    """Every Llama-3.1-8B projection gets a launch with no replicated work, a few programs per
    multiprocessor of a 132-multiprocessor device, and partial sums under 3% of its bytes."""
    from backplane import kernels

    qp = kernels.load_qgemv_packed()
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
        launch = qp.plan(n, k, 132)
        (row_runs, split_k), (_, rows, _), _ = qp._launch(n, k, 132)
        assert launch.fills(), (n, k, launch)
        assert rows % launch.block_n == 0 and row_runs * rows >= n
        assert 4 * 132 <= row_runs * split_k <= 16 * 132, (n, k, row_runs, split_k)
        # each row writes and reads split_k float32 partials; the weight is 0.578 bytes a value
        assert split_k * 8 < 0.03 * k * 0.578, (n, k, split_k)
    # the launches measured fastest at the 8B projections (H200, 132 multiprocessors)
    measured = {
        (6144, 4096): (2, 1024, 1, 12, 2, 1, 1),
        (4096, 4096): (2, 1024, 1, 8, 2, 1, 1),
        (28672, 4096): (2, 1024, 1, 56, 2, 1, 1),
        (4096, 14336): (2, 1024, 1, 28, 2, 1, 1),
    }
    for (n, k), launch in measured.items():
        assert tuple(qp.plan(n, k, 132)) == launch, (n, k, qp.plan(n, k, 132))


def _refusals() -> None:
    """Inputs that are not one row of the weight's width, and outputs that do not fit."""
    from backplane import kernels
    from backplane.kernels.q4k_layout import repack_q4k

    qp = kernels.load_qgemv_packed()
    packed = repack_q4k(torch.zeros(8, 144, dtype=torch.uint8), 256)
    x = torch.zeros(1, 256)
    cases = [
        (torch.zeros(2, 256), {}, "one input row of 256"),
        (torch.zeros(1, 512), {}, "one input row of 256"),
        (torch.zeros(1, 256, dtype=torch.float64), {}, "does not run"),
        (x, {"out": torch.zeros(1, 9)}, "out must be [1, 8]"),
        (x, {"out": torch.zeros(1, 8, dtype=torch.bfloat16)}, "out must be [1, 8]"),
        (x, {"out": torch.zeros(1, 8)}, None),
        (x, {"out": torch.zeros(1, 16)[:, ::2]}, "contiguous"),
    ]
    # rows of a bigger matrix: strided, which the kernel cannot read
    wide = repack_q4k(torch.zeros(8, 288, dtype=torch.uint8), 512)
    strided = type(wide)(*(t[:, : t.shape[1] // 2] for t in wide))
    try:
        qp.packed_gemv(x, strided)
    except ValueError as e:
        assert "contiguous" in str(e), str(e)
    else:
        raise AssertionError("no ValueError for a strided packed weight")
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
            "nibble-order": _nibble_order,
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
