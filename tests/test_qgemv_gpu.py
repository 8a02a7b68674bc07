"""The one-row GGUF kernel (backplane.kernels.qgemv.quantized_gemv) on a GPU.

Each type's product at one input row against the float64 product of the input
and ``gguf.quants.dequantize``'s matrix (numpy), every element, at Llama-3.1-8B
widths (a down projection's 14336 values a row, split across programs on any
device with more than a few multiprocessors), with the output and the split-K
partial sums filled with NaN first; other launches than the planned one (as
``benchmarks/qgemv.py --sweep`` times them); then CUDA-graph captures: a
product captured with one input and replayed with others gives what eager
calls give, bit for bit, and leaves the arrival counters at zero.

Run with ``python -m pytest -m gpu tests/test_qgemv_gpu.py``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from interpreter_checks import kernel_gpu

pytestmark = pytest.mark.gpu

gguf = pytest.importorskip("gguf")

TYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")
#: (rows, values per row): tall (split), wide-ish, and rows not a multiple of a program's
SHAPES = [(1024, 14336), (6144, 4096), (37, 768)]


@pytest.fixture
def device() -> torch.device:
    """The CUDA device, skipping where the kernel cannot run on one."""
    return kernel_gpu()


@functools.cache
def weight(type_name: str, rows: int, cols: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random blocks of ``type_name`` and their float64 matrix (numpy's dequantisation)."""
    from gguf_quant_helpers import QT, random_blocks

    qtype = QT[type_name]
    blocks = random_blocks(qtype, rows, cols, np.random.default_rng(rows + cols))
    w = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float64))
    return blocks, w


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
@pytest.mark.parametrize("type_name", TYPES)
def test_product(device: torch.device, type_name: str, shape: tuple[int, int]) -> None:
    """One row times each type's blocks, in float32 and bfloat16, poisoned output and partials."""
    from gguf_quant_helpers import QT

    from backplane.kernels import load_qgemv

    qgemv = load_qgemv()
    rows, cols = shape
    blocks, w = weight(type_name, rows, cols)
    raw = torch.from_numpy(blocks).to(device)
    qtype = int(QT[type_name])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, cols, generator=torch.Generator().manual_seed(cols)).to(dtype)
        xd = x.to(device)
        _, part = qgemv._scratch(device, 1, 1)
        part.fill_(float("nan"))
        out = torch.full((1, rows), float("nan"), dtype=dtype, device=device)
        got = qgemv.quantized_gemv(xd, raw, qtype, cols, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert_close(got, x, w, f"{type_name} {rows}x{cols} {dtype}")
        again = qgemv.quantized_gemv(xd, raw, qtype, cols)
        assert torch.equal(again, got), "a second run gave other bits"
    counters, _ = qgemv._scratch(device, 1, 1)
    assert not counters.any(), "a launch left arrival counters set"


@pytest.mark.parametrize("launch", [(8, 1, 2), (16, 4, 4), (32, 8, 8), (32, 2, 4)])
@pytest.mark.parametrize("type_name", TYPES)
def test_launches(device: torch.device, type_name: str, launch: tuple[int, int, int]) -> None:
    """Launches other than the planned one (rows per program, splits, warps) give the product."""
    from gguf_quant_helpers import QT

    from backplane.kernels import load_qgemv

    qgemv = load_qgemv()
    rows, cols = SHAPES[0]
    blocks, w = weight(type_name, rows, cols)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    got = qgemv.quantized_gemv(
        x.to(device), torch.from_numpy(blocks).to(device), int(QT[type_name]), cols, launch=launch
    )
    assert_close(got, x, w, f"{type_name} launch {launch}")


@pytest.mark.parametrize("type_name", TYPES)
def test_graph_replay(device: torch.device, type_name: str) -> None:
    """A captured product replayed with new inputs equals eager calls, bit for bit."""
    from gguf_quant_helpers import QT

    from backplane.kernels import load_qgemv

    qgemv = load_qgemv()
    rows, cols = SHAPES[0]
    blocks, w = weight(type_name, rows, cols)
    raw = torch.from_numpy(blocks).to(device)
    qtype = int(QT[type_name])
    static_x = torch.zeros(1, cols, dtype=torch.bfloat16, device=device)
    static_y = torch.empty(1, rows, dtype=torch.bfloat16, device=device)
    # eager warm-up: compiles the kernel and sizes the split-K scratch outside the capture
    qgemv.quantized_gemv(static_x, raw, qtype, cols, out=static_y)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qgemv.quantized_gemv(static_x, raw, qtype, cols, out=static_y)
    for seed in range(3):
        x = torch.randn(1, cols, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        static_x.copy_(x.to(device))
        graph.replay()
        torch.cuda.synchronize()
        eager = qgemv.quantized_gemv(x.to(device), raw, qtype, cols)
        assert torch.equal(static_y, eager), f"replay {seed} differs from the eager call"
        assert_close(static_y, x, w, f"{type_name} replay {seed}")
    counters, _ = qgemv._scratch(device, 1, 1)
    assert not counters.any(), "a replay left arrival counters set"
