"""``backplane.models.linear.dense``: the one matrix multiply of every projection."""

from __future__ import annotations

import pytest
import torch

from backplane.models.linear import Linear, MergedLinear, can_pack, dense


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


needs_packing = pytest.mark.skipif(
    not can_pack(torch.empty(2, 2)), reason="this torch build has no oneDNN weight packing"
)


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 513])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_float64(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    lin = Linear(96, 200, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(200, generator=g))
    w = lin.weight.detach().double().clone()
    b = lin.bias.detach().double().clone() if bias else 0.0
    assert lin.pack(rows=8, release=True)
    # the plain weight's memory is gone: a zero-strided placeholder of the same shape
    assert lin.weight.shape == (200, 96) and lin.weight.stride() == (0, 0)
    x = torch.randn(rows, 96, generator=g)
    with torch.inference_mode():
        y = lin(x)
    torch.testing.assert_close(y.double(), x.double() @ w.T + b, rtol=1e-4, atol=1e-3)


@needs_packing
def test_pack_weights_keeps_shared_weights_and_packs_the_tied_head() -> None:
    from backplane.backends.torch.attention import TorchAttentionBackend
    from backplane.models import load_model

    lm = load_model(
        "tiny-llama", dtype="float32", device="cpu", backends={"attention": TorchAttentionBackend()}
    ).model
    lm.tie_word_embeddings = True  # the embedding matrix doubles as the LM head
    embed = lm.embed_tokens.weight.detach().clone()
    hidden = torch.randn(4, embed.shape[1])
    with torch.inference_mode():
        before = lm.compute_logits(hidden)
    packed = lm.pack_weights_for_cpu(rows=4)
    linears = [m for m in lm.modules() if isinstance(m, Linear)]
    assert packed == len(linears) + 1 and all(m.packed_weight is not None for m in linears)
    assert torch.equal(lm.embed_tokens.weight, embed)  # the lookup still reads it
    with torch.inference_mode():
        after = lm.compute_logits(hidden)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert lm.pack_weights_for_cpu(rows=4) == packed  # idempotent


def test_pack_weights_is_a_no_op_off_cpu_float32() -> None:
    lin = Linear(16, 8)
    lin.to(torch.bfloat16)
    assert not lin.pack(rows=8, release=True)
    assert lin.packed_weight is None and lin.weight.stride() == (16, 1)
