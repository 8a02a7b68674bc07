"""FP8 projections' fused one-row variants on a GPU, and their CUDA-graph replays.

The checks of ``tests/test_fp8_fused.py`` (every variant and scale layout
against float64, the FP8 ``tiny-llama`` generating the same greedy tokens
with the fused kernels as with torch) at a 1B-class layer's shapes, then
captures: an FP8 ``Linear``'s plain, norm + residual + rotary and gated
variants captured with one input and replayed with others give, bit for
bit, what eager calls give.

Run with ``python -m pytest -m gpu tests/test_fp8_fused_gpu.py``; Triton's
e4m3 type needs compute capability 8.9 or newer.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from interpreter_checks import kernel_gpu
from test_fp8_fused import CHECKS, LAYOUTS, equal, fp8_linear, randn, run_check

pytestmark = pytest.mark.gpu


@pytest.fixture
def device() -> torch.device:
    """The CUDA device, skipping where the kernel cannot read e4m3 weights."""
    return kernel_gpu((8, 9), "e4m3 weights")


@pytest.mark.parametrize("check", CHECKS)
def test_check(device: torch.device, check: str) -> None:
    """One check of ``tests/test_fp8_fused.py``, on the GPU at larger shapes."""
    run_check(check, device)


def _replays(
    name: str, inputs: list[torch.Tensor], run: Callable[[], torch.Tensor], seed: int
) -> None:
    """Capture ``run`` over the static ``inputs`` (after an eager warm-up that builds its
    kernel), then replay it with new values in them: each replay equals an eager call."""
    with torch.inference_mode():
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = run()
        for i in range(3):
            for j, t in enumerate(inputs):
                t.copy_(randn(*t.shape, dtype=t.dtype, device=t.device, seed=seed + 10 * i + j))
            graph.replay()
            equal(f"{name} replay {i}", static_out.clone(), run())


@pytest.mark.parametrize("layout", [name for name, _, _ in LAYOUTS])
def test_graph_replay(device: torch.device, layout: str) -> None:
    """An FP8 ``Linear``'s fused variants replay in a CUDA graph as they run eagerly."""
    from backplane.models.linear import RotaryEpilogue

    dtype = torch.bfloat16
    hq, hk, d, hidden, inner = 16, 4, 128, 2048, 5632
    qkv, _ = fp8_linear(
        (hq + 2 * hk) * d, hidden, layout, dtype=dtype, device=device, seed=31, bias=False
    )
    down, _ = fp8_linear(hidden, inner, layout, dtype=dtype, device=device, seed=32, bias=False)
    x = torch.zeros(1, hidden, dtype=dtype, device=device)
    r = torch.zeros_like(x)
    g = randn(hidden, dtype=dtype, device=device, seed=33) + 1
    cos = torch.zeros(1, d // 2, dtype=dtype, device=device)
    sin = torch.zeros_like(cos)
    rotary = RotaryEpilogue(cos, sin, (hq + hk) * d)

    def normed() -> torch.Tensor:
        out = qkv.forward_normed(x, r, g, 1e-5, False, rotary=rotary)
        assert out is not None, "the fused kernel was not taken"
        return torch.cat([out[0], out[1]], dim=1)

    _replays(f"{layout} norm + rotary", [x, r, cos, sin], normed, seed=40)
    _replays(f"{layout} plain", [x], lambda: qkv(x), seed=50)
    gate_up = torch.zeros(1, 2 * inner, dtype=dtype, device=device)

    def gated() -> torch.Tensor:
        y = down.forward_gated(gate_up, "silu")
        assert y is not None, "the fused kernel was not taken"
        return y

    _replays(f"{layout} gated", [gate_up], gated, seed=60)
