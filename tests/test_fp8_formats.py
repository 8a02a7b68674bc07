"""The FP8 (e4m3) number format: weight and activation quantisation, scale layouts, the projection."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from backplane.models.linear import Linear, MergedLinear
from backplane.models.quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_rows,
    quantize_per_block,
    quantize_per_token,
    quantize_weight,
    row_scales,
)
from backplane.models.quant.projection import convert_linear, quantize_linear

#: e4m3 keeps 3 mantissa bits: a normal value rounds to within half a step, 2**-4 relative
REL = 2.0**-4
#: the step of e4m3's subnormals (2**-9), the absolute error floor in units of the scale
SUB = 2.0**-9


def _within_rounding(x: torch.Tensor, approx: torch.Tensor, scale: torch.Tensor) -> bool:
    err = (approx.double() - x.double()).abs()
    bound = REL * x.double().abs() + SUB * scale.double()
    return bool((err <= bound * (1 + 1e-6)).all())


def _block_scale_loop(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """Each block's amax / 448, one block at a time."""
    rows, cols = w.shape
    out = torch.empty(math.ceil(rows / bn), math.ceil(cols / bk), dtype=torch.float64)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().max().double() / 448
    return out


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_weight_quantisation_scales_and_rounding(granularity: str) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 300, generator=g) * torch.rand(70, 1, generator=g) * 3
    q, scale = quantize_weight(w, granularity, block=(32, 128))
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and scale.dtype == torch.float32
    if granularity == "tensor":
        want = torch.tensor([w.abs().max().item() / 448], dtype=torch.float64)
        per_row = row_scales(scale, 70, 300, "tensor", (32, 128))
        block_k = 300
    elif granularity == "channel":
        want = w.abs().amax(dim=1, keepdim=True).double() / 448
        per_row = row_scales(scale, 70, 300, "channel", (32, 128))
        block_k = 300
    else:
        want = _block_scale_loop(w, 32, 128)
        per_row = row_scales(scale, 70, 300, "block", (32, 128))
        block_k = 128
    torch.testing.assert_close(scale.double(), want, rtol=1e-6, atol=0)
    # every element's scale, written out one element at a time for the block case
    elem = torch.empty(70, 300, dtype=torch.float64)
    for r in range(70):
        for c in range(0, 300, block_k):
            elem[r, c : c + block_k] = per_row[r, c // block_k]
    deq = dequantize_rows(q, per_row, block_k, torch.float64)
    torch.testing.assert_close(deq, q.double() * elem, rtol=1e-6, atol=0)
    assert _within_rounding(w, deq, elem)
    # the largest value of each scale group lands on e4m3's largest value
    assert q.float().abs().max().item() == FP8_MAX


def test_row_scales_expand_blocks_and_refuse_a_misfit() -> None:
    s = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    rows = row_scales(s, 5, 200, "block", (2, 128))
    assert rows.shape == (5, 2)
    for r in range(5):
        assert rows[r].tolist() == s[r // 2].tolist()
    assert row_scales(torch.tensor(0.5), 4, 8, "tensor", (128, 128)).tolist() == [[0.5]] * 4
    with pytest.raises(ValueError, match="does not fit"):
        row_scales(s, 9, 200, "block", (2, 128))
    with pytest.raises(ValueError, match="fits neither"):
        row_scales(torch.ones(3), 4, 8, "channel", (128, 128))


def test_activation_quantisation_per_token_and_per_block() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 260, generator=g) * torch.tensor([0.01, 1, 10, 100, 1000])[:, None]
    q, s = quantize_per_token(x)
    assert s.shape == (5, 1)
    torch.testing.assert_close(s.double(), x.abs().amax(1, keepdim=True).double() / 448)
    assert _within_rounding(x, q.double() * s.double(), s.expand(5, 260))
    qb, sb = quantize_per_block(x, 128)
    assert sb.shape == (5, 3)
    elem = sb.repeat_interleave(128, dim=1)[:, :260]
    for j in range(3):
        want = x[:, j * 128 : (j + 1) * 128].abs().amax(1).double() / 448
        torch.testing.assert_close(sb[:, j].double(), want)
    assert _within_rounding(x, qb.double() * elem.double(), elem)


def test_fp8_projection_on_cpu_equals_the_dequantised_weight() -> None:
    g = torch.Generator().manual_seed(2)
    lin = Linear(64, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g))
        lin.bias.copy_(torch.randn(48, generator=g))
    w = lin.weight.detach().clone()
    quantize_linear(lin)
    assert lin.weight.dtype == FP8_DTYPE and lin.weight_scale.shape == (48, 1)
    deq = lin.weight.float() * lin.weight_scale
    assert _within_rounding(w, deq, lin.weight_scale.expand(48, 64))
    x = torch.randn(3, 64, generator=g)
    with torch.no_grad():
        got = lin(x)
    torch.testing.assert_close(got, F.linear(x, deq, lin.bias), rtol=1e-5, atol=1e-5)


def test_merged_fp8_projection_loads_each_part_into_its_rows() -> None:
    lin = MergedLinear(32, [("q_proj", 16), ("k_proj", 8)])
    convert_linear(lin, 16)
    assert lin.weight.dtype == FP8_DTYPE and lin.weight_scale.shape == (24, 2)
    slices = dict(lin.checkpoint_slices())
    assert slices["k_proj.weight_scale"].shape == (8, 2)
    assert slices["q_proj.weight"].shape == (16, 32)
    with torch.no_grad():
        slices["k_proj.weight_scale"].fill_(3.0)
    assert lin.weight_scale[16:].eq(3.0).all() and lin.weight_scale[:16].eq(1.0).all()


def test_fp8_projection_traces_as_one_graph() -> None:
    """The piecewise CUDA-graph runner traces the model with ``torch.compile``."""
    g = torch.Generator().manual_seed(3)
    lin = Linear(64, 32)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(32, 64, generator=g))
    quantize_linear(lin)
    x = torch.randn(4, 64, generator=g)
    with torch.no_grad():
        traced = torch.compile(lin, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(traced(x), lin(x), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_scaled_mm_matches_per_token_quantised_activations(rows: int) -> None:
    """On sm89+ the product runs in FP8: the activations rounded per token, the weight per row."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA device of compute capability 8.9 or higher")
    g = torch.Generator().manual_seed(4)
    lin = Linear(256, 128, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(128, 256, generator=g))
        lin.bias.copy_(torch.randn(128, generator=g))
    quantize_linear(lin)
    # Module.to(dtype) would cast the e4m3 weight too: move it, then make the bias bfloat16
    lin = lin.to("cuda")
    lin.bias.data = lin.bias.data.to(torch.bfloat16)
    x = torch.randn(rows, 256, generator=g).to("cuda", torch.bfloat16)
    with torch.no_grad():
        got = lin(x)
    qx, sx = quantize_per_token(x.cpu())
    want = (qx.double() * sx.double()) @ (
        lin.weight.cpu().double() * lin.weight_scale.cpu().double()
    ).T + lin.bias.cpu().double()
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-2, atol=2e-2)
