"""``backplane.models.linear.dense``: the one matrix multiply of every projection."""

from __future__ import annotations

import pytest
import torch

from backplane.models.linear import Linear, MergedLinear, dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead", [(1,), (8,), (3, 5), (0,)])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_matches_float64(dtype: torch.dtype, lead: tuple[int, ...], bias: bool) -> None:
    g = torch.Generator().manual_seed(sum(lead) + bias)
    x = torch.randn(*lead, 96, generator=g).to(dtype)
    w = torch.randn(200, 96, generator=g).to(dtype)
    b = torch.randn(200, generator=g).to(dtype) if bias else None
    with torch.inference_mode():
        y = dense(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if bias else 0.0)
    assert y.shape == (*lead, 200) and y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * 10)


def test_dense_keeps_autograd_when_grad_is_enabled() -> None:
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(8, 16)
    dense(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(4, 16))


def test_linear_modules_run_through_dense() -> None:
    torch.manual_seed(0)
    lin = Linear(32, 48, bias=True)
    merged = MergedLinear(32, [("q_proj", 16), ("k_proj", 32)], bias=False)
    x = torch.randn(5, 32)
    with torch.inference_mode():
        for m in (lin, merged):
            ref = x.double() @ m.weight.double().T
            if m.bias is not None:
                ref = ref + m.bias.double()
            torch.testing.assert_close(m(x).double(), ref, rtol=1e-4, atol=1e-4)
