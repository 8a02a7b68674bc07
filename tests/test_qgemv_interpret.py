"""The one-row GGUF kernel (backplane.kernels.qgemv.quantized_gemv) over many shapes, in the interpreter.

Each check multiplies one input row by random GGUF blocks of one type and
compares every output element with the float64 product of the input and
``gguf.quants.dequantize``'s matrix (numpy, independent of backplane's
dequantisation). The output and the split-K partial sums are filled with NaN
before the call, so an element the kernel does not write, or a partial it
sums without writing, fails the check. Shapes: a tall one (14336 values a row,
the reduction split across programs), a wide one (96 rows of 2048), and rows
that are not a multiple of the rows per program. Every split launch must
leave the arrival counters at zero (so that the next launch, or a graph
replay, starts clean) and give the same bits when run again.

The checks run in one child process under ``TRITON_INTERPRET=1`` (see
``tests/interpreter_checks.py``); one by hand::

    TRITON_INTERPRET=1 python tests/test_qgemv_interpret.py Q4_K-tall
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from interpreter_checks import interpreter_tests, main

ROOT = Path(__file__).resolve().parent.parent

#: name -> (rows, values per row)
SHAPES = {"tall": (20, 14336), "wide": (96, 2048), "odd": (37, 768)}
TYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")
CHECKS = [f"{t}-{s}" for t in TYPES for s in SHAPES] + ["Q8_0-blocks", "bf16", "plan", "refusals"]


def _product(qtype_name: str, rows: int, cols: int, dtype: torch.dtype, seed: int) -> None:
    """One product against the float64 reference; raises AssertionError on a wrong element."""
    import gguf
    from gguf_quant_helpers import QT, random_blocks

    from backplane import kernels

    qgemv = kernels.load_qgemv()
    qtype = QT[qtype_name]
    rng = np.random.default_rng(seed)
    blocks = random_blocks(qtype, rows, cols, rng)
    w = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float64))
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)
    raw = torch.from_numpy(blocks)
    block_size = qgemv.LAYOUTS[int(qtype)][0]
    step = qgemv._STEPS[int(qtype)][0]
    _, split_k = qgemv.plan(rows, cols // block_size, step, qgemv._sm_count(x.device))
    if split_k > 1:
        # partials the kernel must overwrite before it sums them
        counters, part = qgemv._scratch(x.device, 1, split_k * rows)
        part.fill_(float("nan"))
    out = torch.full((1, rows), float("nan"), dtype=dtype)
    got = qgemv.quantized_gemv(x, raw, int(qtype), cols, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == (1, rows), got.shape
    want = x.double() @ w.T
    eps = torch.finfo(dtype).eps
    # float32 sums, then one rounding (truncation in the interpreter) to the dtype
    bound = 1e-5 * (x.double().abs() @ w.abs().T) + 2 * eps * want.abs() + 1e-6
    err = (got.double() - want).abs()
    bad = ~(err <= bound)
    assert not bad.any(), (
        f"{qtype_name} {rows}x{cols}: {int(bad.sum())} wrong elements, first at "
        f"{bad.nonzero()[0].tolist()}: got {got.double()[bad][0]:.6g}, want {want[bad][0]:.6g}"
    )
    if split_k > 1:
        counters, _ = qgemv._scratch(x.device, 1, 1)
        assert not counters.any(), "the split launch left arrival counters set"
        again = qgemv.quantized_gemv(x, raw, int(qtype), cols)
        assert torch.equal(again, got), "a second run gave other bits"


def _plan() -> None:
    """Every Llama-3.1-8B projection fills a 132-multiprocessor device with programs."""
    from backplane import kernels

    qgemv = kernels.load_qgemv()
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
    for t, (block_size, _) in qgemv.LAYOUTS.items():
        step = qgemv._STEPS[t][0]
        for n, k in shapes:
            block_n, split_k = qgemv.plan(n, k // block_size, step, 132)
            programs = -(-n // block_n) * split_k
            assert programs >= 15 * 132 or k // block_size // split_k < 4 * step, (t, n, k)
            # each split keeps at least two iterations of blocks
            assert k // block_size // split_k >= 2 * step, (t, n, k, split_k)


def _refusals() -> None:
    """An input that is not one row of the weight's width, or an ``out`` that does not fit,
    is refused with a message naming what was expected."""
    from gguf_quant_helpers import QT

    from backplane import kernels

    qgemv = kernels.load_qgemv()
    raw = torch.zeros(8, 144, dtype=torch.uint8)
    x = torch.zeros(1, 256)
    cases = [
        (torch.zeros(2, 256), {}, "one input row of 256"),
        (torch.zeros(1, 512), {}, "one input row of 256"),
        (x, {"out": torch.zeros(1, 9)}, "out must be [1, 8]"),
        (x, {"out": torch.zeros(1, 8, dtype=torch.bfloat16)}, "out must be [1, 8]"),
        (x, {"out": torch.zeros(1, 8)}, None),
        (x, {"out": torch.zeros(1, 16)[:, ::2]}, "contiguous"),
    ]
    for xi, kwargs, message in cases:
        if message is None:
            qgemv.quantized_gemv(xi, raw, int(QT.Q4_K), 256, **kwargs)
            continue
        try:
            qgemv.quantized_gemv(xi, raw, int(QT.Q4_K), 256, **kwargs)
        except ValueError as e:
            assert message in str(e), (message, str(e))
        else:
            raise AssertionError(f"no ValueError for {tuple(xi.shape)} {kwargs}")


def _check(name: str) -> None:
    """Run one check by name."""
    sys.path.insert(0, str(ROOT / "tests"))
    if name == "plan":
        _plan()
    elif name == "refusals":
        _refusals()
    elif name == "bf16":
        _product("Q4_K", 24, 4096, torch.bfloat16, 3)
    elif name == "Q8_0-blocks":
        # 3 blocks a row: fewer than one iteration's 16
        _product("Q8_0", 5, 96, torch.float32, 4)
    else:
        qtype, shape = name.split("-")
        rows, cols = SHAPES[shape]
        _product(qtype, rows, cols, torch.float32, len(name))


# -- the pytest side ------------------------------------------------------------------------

if __name__ != "__main__":
    import pytest

    pytest.importorskip("gguf")

    interpret_results, test_in_interpreter = interpreter_tests(__file__, CHECKS)


# -- the child side -------------------------------------------------------------------------

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CHECKS, _check))
