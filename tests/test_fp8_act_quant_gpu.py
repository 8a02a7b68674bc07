"""The FP8 activation quantisation kernel on a GPU, bit for bit against torch's CUDA reference.

The twin of ``tests/test_fp8_act_quant.py`` (the Triton interpreter's checks)
at serving sizes (8192 rows of 4096 columns) and at odd ones, with the
output poisoned; and an FP8 :class:`~backplane.models.linear.Linear` whose
several input rows run ``torch._scaled_mm``: its output with the kernel
quantising the activations (per token, or with a static ``input_scale``;
eager and under ``torch.compile``) equals, bit for bit, its output with the
torch operations doing it.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_checks import kernel_gpu

from backplane.models.linear import Linear
from backplane.models.quant import fp8
from backplane.models.quant.fp8 import quantize_per_token_eager, quantize_weight, to_fp8
from backplane.models.quant.projection import convert_linear, quantize_linear

pytestmark = pytest.mark.gpu

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: ``(M, K)``: the serving size, one column, odd widths, a width read in pieces
SHAPES = ((8192, 4096), (1, 1), (3, 17), (5, 4099), (3, 14336))


@pytest.fixture
def device() -> torch.device:
    """The GPU, where e4m3 conversions run in Triton (compute capability 8.9+)."""
    return kernel_gpu((8, 9), "FP8 activation quantisation and torch._scaled_mm")


def _rows(m: int, k: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Seeded rows of magnitudes 1e-2 to 1e4 with tiny values among them, the first zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float32)
    x *= torch.logspace(-2, 4, m)[:, None]
    x[:, ::7] *= 1e-5
    x[0] = 0.0
    return x.to(device, dtype)


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    as_int = {
        torch.float32: torch.int32,
        torch.float8_e4m3fn: torch.uint8,
        torch.bfloat16: torch.int16,
        torch.float16: torch.int16,
    }
    g, w = got.view(as_int[got.dtype]), want.view(as_int[want.dtype])
    bad = int((g != w).sum())
    assert bad == 0, f"{what}: {bad} of {g.numel()} elements differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_per_token_and_static_bitwise(
    device: torch.device, dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    """q bits and scales equal to the torch operations on the same GPU, into a poisoned buffer."""
    from backplane.kernels import act_quant

    m, k = shape
    x = _rows(m, k, dtype, device, seed=m + k)
    want_q, want_s = quantize_per_token_eager(x)
    out = torch.full((m, k), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    q, s = act_quant.quantize_per_token(x, out=out)
    _same(s, want_s, "scales")
    _same(q, want_q, "e4m3 values")
    # the dispatching function picks the kernel on this device
    assert fp8._kernel(x) is act_quant
    q2, s2 = fp8.quantize_per_token(x)
    _same(q2, want_q, "quantize_per_token")
    _same(s2, want_s, "quantize_per_token scales")
    scale = torch.tensor([0.0371], device=device)
    _same(fp8.quantize_static(x, scale), to_fp8(x, scale), "static scale")


def _fp8_linear(device: torch.device, static: bool, seed: int) -> Linear:
    """A 4096 -> 1024 FP8 projection with a bias, its weight quantised per row."""
    g = torch.Generator().manual_seed(seed)
    lin = Linear(4096, 1024, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(1024, 4096, generator=g) * 0.02)
        lin.bias.copy_(torch.randn(1024, generator=g))
    if static:
        q, scale = quantize_weight(lin.weight, "channel")
        convert_linear(lin, None, static=True)
        with torch.no_grad():
            lin.weight.copy_(q)
            lin.weight_scale.copy_(scale)
            lin.input_scale.fill_(0.0123)
    else:
        quantize_linear(lin)
    lin = lin.to(device)
    lin.bias.data = lin.bias.data.to(torch.bfloat16)
    return lin


@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_linear_output_equals_torch_path(
    device: torch.device, static: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multi-row FP8 projection gives the same bits with the kernel as with torch's ops."""
    lin = _fp8_linear(device, static, seed=5)
    x = _rows(2048, 4096, torch.bfloat16, device, seed=6)
    x[0] = torch.randn(4096, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")(x)
    from backplane.kernels import act_quant

    calls = []
    name = "quantize_static" if static else "quantize_per_token"
    real = getattr(act_quant, name)
    monkeypatch.setattr(act_quant, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        got = lin(x)
    assert calls, "the kernel did not run"
    # the torch operations quantise on this device from here on
    monkeypatch.setitem(fp8._KERNEL, str(device), None)
    with torch.no_grad():
        want = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2048, 1024)
    _same(got, want, "projection output")
    _same(compiled, want, "compiled projection output")
