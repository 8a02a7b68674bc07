"""The one-row kernel over repacked Q4_K (backplane.kernels.qgemv_packed) on a GPU.

The product at one input row against the float64 product of the input and
``gguf.quants.dequantize``'s matrix (numpy), every element, at Llama-3.1-8B
widths (a down projection's 14336 values a row, split 28 ways) in float32,
bfloat16 and float16, with the output and the split-K partial sums filled
with NaN first; launches other than the planned one (as
``benchmarks/qgemv_packed.py --sweep`` times them); one-hot inputs that read
out columns exactly (the nibble order); the dequantising kernel; then
CUDA-graph captures: a product captured with one input and replayed with
others gives what eager calls give, bit for bit, and leaves the arrival
counters at zero.

Run with ``python -m pytest -m gpu tests/test_qgemv_packed_gpu.py``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from interpreter_checks import kernel_gpu

pytestmark = pytest.mark.gpu

gguf = pytest.importorskip("gguf")

#: (rows, values per row): tall (split), the q/k/v shape, and rows not a multiple of a tile
SHAPES = [(1024, 14336), (6144, 4096), (37, 768)]


@pytest.fixture
def device() -> torch.device:
    """The CUDA device, skipping where the kernel cannot run on one."""
    return kernel_gpu()


@functools.cache
def weight(rows: int, cols: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random Q4_K blocks and their float64 matrix (numpy's dequantisation)."""
    from gguf_quant_helpers import QT, random_blocks

    blocks = random_blocks(QT.Q4_K, rows, cols, np.random.default_rng(rows + cols))
    return blocks, torch.from_numpy(gguf.quants.dequantize(blocks, QT.Q4_K).astype(np.float64))


def packed_weight(rows: int, cols: int, device: torch.device):
    """The blocks of :func:`weight`, repacked on ``device``."""
    from backplane.kernels.q4k_layout import repack_q4k

    blocks, _ = weight(rows, cols)
    return repack_q4k(torch.from_numpy(blocks).to(device), cols)


def assert_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    """Every element of ``got`` within float32 sums and one rounding of ``x @ w.T``."""
    xd = x.double().cpu()
    want = xd @ w.T
    eps = torch.finfo(got.dtype).eps
    bound = 1e-5 * (xd.abs() @ w.abs().T) + eps * want.abs() + 1e-6
    err = (got.double().cpu() - want).abs()
    bad = ~(err <= bound)
    assert not bad.any(), f"{what}: {int(bad.sum())} wrong elements, max error {err.max():.3g}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_product(device: torch.device, shape: tuple[int, int]) -> None:
    """One row times the packed weight in three dtypes, poisoned output and partials."""
    from backplane.kernels import load_qgemv_packed

    qp = load_qgemv_packed()
    rows, cols = shape
    _, w = weight(rows, cols)
    packed = packed_weight(rows, cols, device)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(1, cols, generator=torch.Generator().manual_seed(cols)).to(dtype)
        xd = x.to(device)
        _, part = qp._scratch(device, 1, 1)
        part.fill_(float("nan"))
        out = torch.full((1, rows), float("nan"), dtype=dtype, device=device)
        got = qp.packed_gemv(xd, packed, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert_close(got, x, w, f"{rows}x{cols} {dtype}")
        again = qp.packed_gemv(xd, packed)
        assert torch.equal(again, got), "a second run gave other bits"
    counters, _ = qp._scratch(device, 1, 1)
    assert not counters.any(), "a launch left arrival counters set"


@pytest.mark.parametrize(
    "launch",
    [
        (8, 512, 2, 64, 2, 1),
        (16, 512, 4, 128, 2, 1),
        (8, 1024, 2, 48, 2, 2),
        (8, 256, 1, 32, 2, 1),
        (16, 512, 2, 40, 1, 1),
        (4, 1024, 4, 8, 1, 2),
        (8, 512, 2, 48, 1, 1, 1),
        (2, 1024, 1, 56, 2, 1, 1),
        (4, 512, 1, 40, 1, 1, 2),
        (2, 1024, 1, 12, 2, 1, 2),
    ],
    ids=str,
)
def test_launches(device: torch.device, launch: tuple[int, ...]) -> None:
    """Launches other than the planned one give the product."""
    from backplane.kernels import load_qgemv_packed

    qp = load_qgemv_packed()
    launch = qp.Launch(*launch)
    assert launch.fills()
    rows, cols = SHAPES[0]
    _, w = weight(rows, cols)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    got = qp.packed_gemv(x.to(device), packed_weight(rows, cols, device), launch=launch)
    assert_close(got, x, w, f"launch {launch}")


def test_nibble_order(device: torch.device) -> None:
    """One-hot inputs read out the columns of a group, to a rounding of each value."""
    from backplane.kernels import load_qgemv_packed

    qp = load_qgemv_packed()
    rows, cols = 37, 768
    _, w = weight(rows, cols)
    packed = packed_weight(rows, cols, device)
    for k in range(256, 288):
        x = torch.zeros(1, cols, device=device)
        x[0, k] = 1.0
        got = qp.packed_gemv(x, packed)[0].double().cpu()
        # d*sc*q - dmin*m may be contracted into one multiply-add: a float32 ulp or so
        assert ((got - w[:, k]).abs() <= 2.4e-7 * w[:, k].abs() + 1e-30).all(), k


def test_dequantize(device: torch.device) -> None:
    """The dequantising kernel gives gguf's values, rounded to each dtype."""
    from backplane.kernels import load_qgemv_packed

    qp = load_qgemv_packed()
    rows, cols = SHAPES[2]
    _, w = weight(rows, cols)
    packed = packed_weight(rows, cols, device)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = qp.dequantize_packed_matrix(packed, dtype)
        assert got.shape == (rows, cols) and got.dtype == dtype
        # float32: the reference's values (a contracted multiply-add may move the last bit)
        tol = 2.4e-7 if dtype == torch.float32 else torch.finfo(dtype).eps
        assert ((got.double().cpu() - w).abs() <= tol * w.abs()).all(), dtype


def test_graph_replay(device: torch.device) -> None:
    """A captured product replayed with new inputs equals eager calls, bit for bit."""
    from backplane.kernels import load_qgemv_packed

    qp = load_qgemv_packed()
    rows, cols = SHAPES[0]
    _, w = weight(rows, cols)
    packed = packed_weight(rows, cols, device)
    static_x = torch.zeros(1, cols, dtype=torch.bfloat16, device=device)
    static_y = torch.empty(1, rows, dtype=torch.bfloat16, device=device)
    # eager warm-up: compiles the kernel and sizes the split-K scratch outside the capture
    qp.packed_gemv(static_x, packed, out=static_y)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qp.packed_gemv(static_x, packed, out=static_y)
    for seed in range(3):
        x = torch.randn(1, cols, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        static_x.copy_(x.to(device))
        graph.replay()
        torch.cuda.synchronize()
        eager = qp.packed_gemv(x.to(device), packed)
        assert torch.equal(static_y, eager), f"replay {seed} differs from the eager call"
        assert_close(static_y, x, w, f"replay {seed}")
    counters, _ = qp._scratch(device, 1, 1)
    assert not counters.any(), "a replay left arrival counters set"
