"""The one-row projection kernel with FP8 (e4m3) weights, on a GPU.

The checks of ``tests/test_fp8_gemv.py`` (every scale layout, odd shapes,
split and unsplit, poisoned partial sums, against float64 over the
dequantised weight; the riders; the refusals; FP8 ``Linear`` routing) at
larger shapes (block scales read in chunks of several blocks at DeepSeek-V3's
7168 -> 2048 and 2048 -> 7168 with 128x128 blocks, every element against
float64), then CUDA-graph captures: a projection captured with one input and
replayed with others gives what eager calls give, for each scale layout (in
chunks within a scale block and holding several) and for an FP8 ``Linear``
(its kernel built in the eager warm-up call).

Run with ``python -m pytest -m gpu tests/test_fp8_gemv_gpu.py``; Triton's e4m3
type needs compute capability 8.9 or newer.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_checks import kernel_gpu
from test_fp8_gemv import CHECKS, LAYOUTS, equal, kernel_scales, quantized, run_check

pytestmark = pytest.mark.gpu


@pytest.fixture
def device() -> torch.device:
    """The CUDA device, skipping where the kernel cannot read e4m3 weights."""
    return kernel_gpu((8, 9), "e4m3 weights")


@pytest.mark.parametrize("check", CHECKS)
def test_check(device: torch.device, check: str) -> None:
    """One check of ``tests/test_fp8_gemv.py``, on the GPU at larger shapes."""
    run_check(check, device)


@pytest.mark.parametrize("layout", [name for name, _ in LAYOUTS])
@pytest.mark.parametrize("launch", [(16, 128, 1), (16, 128, 4), (8, 1024, 2)])
def test_graph_replay(device: torch.device, layout: str, launch: tuple[int, int, int]) -> None:
    """A captured FP8 projection replayed with new inputs equals eager calls, bit for bit
    (the split-K arrival counters are left at zero by every launch)."""
    from backplane.kernels import load_gemv

    gemv = load_gemv()
    gran = dict(LAYOUTS)[layout]
    n, k = 2048, 8192
    q, scale, rows = quantized(n, k, gran, device, seed=21)
    s, scale_k, scale_n = kernel_scales(layout, scale, rows)
    proj = gemv.OneRowProjection(
        q, launch=launch, scale=s, scale_k=scale_k, scale_n=scale_n, dtype=torch.bfloat16
    )
    static_x = torch.zeros(1, k, dtype=torch.bfloat16, device=device)
    proj(static_x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y, _ = proj(static_x)
    for i in range(3):
        gen = torch.Generator(device="cpu").manual_seed(100 + i)
        x = torch.randn(1, k, generator=gen).to(device, torch.bfloat16)
        static_x.copy_(x)
        graph.replay()
        equal(f"{layout} replay {i}", static_y.clone(), proj(x)[0])


def test_linear_graph_replay(device: torch.device) -> None:
    """An FP8 ``Linear`` (block scales) captured at one row replays its kernel: the replays
    equal eager one-row calls, and two rows still take the other path."""
    from backplane.models.linear import Linear
    from backplane.models.quant.projection import convert_linear

    n, k = 2048, 8192
    lin = Linear(k, n, bias=True).to(device, torch.bfloat16)
    q, _, rows = quantized(n, k, "block", device, seed=22)
    with torch.no_grad():
        convert_linear(lin, 128)
        lin.weight.copy_(q)
        lin.weight_scale.copy_(rows)
    lin.fused_ops = "triton"
    static_x = torch.zeros(1, k, dtype=torch.bfloat16, device=device)
    with torch.inference_mode():
        lin(static_x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = lin(static_x)
        for i in range(3):
            gen = torch.Generator(device="cpu").manual_seed(200 + i)
            x = torch.randn(1, k, generator=gen).to(device, torch.bfloat16)
            static_x.copy_(x)
            graph.replay()
            equal(f"Linear replay {i}", static_y.clone(), lin(x))
        assert len([p for p in lin._projections.values() if p]) == 1
        assert lin(torch.zeros(2, k, dtype=torch.bfloat16, device=device)).shape == (2, n)
