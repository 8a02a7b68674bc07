"""The fused model functions against unfused float64 references and transformers' code.

Each function of :mod:`backplane.models.fused` is checked on every element, in
float32 and bfloat16, against the same arithmetic done op by op in float64 on
the same (upcast) inputs; where transformers has the same function, the result
must also equal transformers' bit for bit (the rounding steps are kept).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from backplane.core.errors import ConfigError
from backplane.models.fused import (
    act_and_mul,
    apply_rotary_,
    apply_rotary_interleaved,
    check_fused_ops,
    fused_add_rms_norm,
    relu_squared,
    rms_norm,
    silu_and_mul,
)
from backplane.models.linear import MergedLinear
from backplane.models.mlp import gated_activation
from backplane.models.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    """A few units in the last place of ``dtype`` (relative), plus a small absolute slack."""
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-6}
    return {"rtol": 2**-6, "atol": 2**-8}


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    x64 = x.double()
    normed = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return normed * ((1.0 + w.double()) if zero_centered else w.double())


# -- RMS norm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_matches_float64(dtype, zero_centered):
    # Rows of very different scales: the statistic must be per row.
    x = _randn(7, 96, dtype=dtype, seed=0) * torch.logspace(-2, 2, 7)[:, None].to(dtype)
    w = _randn(96, dtype=dtype, seed=1, scale=0.5) + (0 if zero_centered else 1)
    got = rms_norm(x, w, 1e-6, zero_centered)
    assert got.dtype == dtype and got.shape == x.shape
    want = _rms_ref(x, w, 1e-6, zero_centered)
    torch.testing.assert_close(got.double(), want, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_strided_views(dtype):
    base = _randn(5, 3, 40, dtype=dtype, seed=2)
    view = base[:, 1, 8:]  # neither contiguous nor starting at zero
    w = _randn(32, dtype=dtype, seed=3)
    got = rms_norm(view, w, 1e-5)
    torch.testing.assert_close(got.double(), _rms_ref(view, w, 1e-5, False), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_equals_transformers(dtype, zero_centered):
    if zero_centered:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm as Norm
    else:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm as Norm
    norm = Norm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(64, dtype=dtype, seed=4, scale=0.3))
    x = _randn(9, 64, dtype=dtype, seed=5, scale=3.0)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, norm.weight, 1e-6, zero_centered), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_fused_add_rms_norm_matches_add_then_norm(dtype, zero_centered):
    x = _randn(6, 80, dtype=dtype, seed=6)
    residual = _randn(6, 80, dtype=dtype, seed=7, scale=4.0)
    w = _randn(80, dtype=dtype, seed=8, scale=0.5)
    x_before, res_before = x.clone(), residual.clone()
    normed, new_residual = fused_add_rms_norm(x, residual, w, 1e-6, zero_centered)
    # The residual stream is the sum in the activations' dtype, as the HF layers carry it.
    assert new_residual.dtype == dtype
    assert torch.equal(new_residual, x + residual)
    torch.testing.assert_close(new_residual.double(), x.double() + residual.double(), **_tol(dtype))
    torch.testing.assert_close(
        normed.double(), _rms_ref(new_residual, w, 1e-6, zero_centered), **_tol(dtype)
    )
    # Inputs are not modified.
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)


# -- activations ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_float64(dtype):
    x = _randn(5, 2 * 48, dtype=dtype, seed=9, scale=3.0)
    got = silu_and_mul(x)
    assert got.shape == (5, 48) and got.dtype == dtype
    g, u = x.double()[:, :48], x.double()[:, 48:]
    want = g / (1 + torch.exp(-g)) * u
    torch.testing.assert_close(got.double(), want, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_pytorch_tanh", "relu2"])
def test_gated_activation_over_a_fused_gate_up(dtype, name):
    x = _randn(4, 64, dtype=dtype, seed=10, scale=2.0)
    g, u = x.double()[:, :32], x.double()[:, 32:]
    ref_act = {
        "silu": lambda t: t / (1 + torch.exp(-t)),
        "gelu": lambda t: 0.5 * t * (1 + torch.erf(t / math.sqrt(2))),
        "gelu_pytorch_tanh": lambda t: (
            0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t**3)))
        ),
        "relu2": lambda t: torch.clamp(t, min=0) ** 2,
    }[name]
    got = gated_activation(name)(x)
    torch.testing.assert_close(got.double(), ref_act(g) * u, **_tol(dtype))
    if name == "silu":
        assert gated_activation(name) is silu_and_mul


@pytest.mark.parametrize("dtype", DTYPES)
def test_act_and_mul_and_relu_squared(dtype):
    x = _randn(3, 40, dtype=dtype, seed=11, scale=2.0)
    got = act_and_mul(x, torch.tanh)
    torch.testing.assert_close(
        got.double(), torch.tanh(x.double()[:, :20]) * x.double()[:, 20:], **_tol(dtype)
    )
    r2 = relu_squared(x)
    torch.testing.assert_close(r2.double(), torch.clamp(x.double(), min=0) ** 2, **_tol(dtype))
    assert (r2[x <= 0] == 0).all()


# -- rotary ----------------------------------------------------------------------------------------


def _cos_sin(t: int, h: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ang = _randn(t, 1, h, dtype=torch.float64, seed=seed, scale=3.0)
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs) -> torch.Tensor:
    """Float64, one channel pair at a time; the pair's outputs go to ``(i, i + h)``."""
    x64, c, s = x.double(), cos.double(), sin.double()
    h = cos.shape[-1]
    out = x64.clone()
    for i, (a, b) in enumerate(pairs):
        out[..., i] = x64[..., a] * c[..., i] - x64[..., b] * s[..., i]
        out[..., i + h] = x64[..., b] * c[..., i] + x64[..., a] * s[..., i]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot", [16, 4])  # full and partial rotary of a 16-channel head
def test_apply_rotary_in_place_on_a_fused_qkv_view(dtype, rot):
    t, hq, hk, d = 5, 4, 2, 16
    qkv = _randn(t, (hq + 2 * hk) * d, dtype=dtype, seed=12)
    before = qkv.clone()
    cos, sin = _cos_sin(t, rot // 2, dtype, seed=13)
    qk = qkv[:, : (hq + hk) * d].view(t, hq + hk, d)  # strided: v follows in each row
    out = apply_rotary_(qk, cos, sin)
    assert out is qk
    want = _rotate_ref(
        before[:, : (hq + hk) * d].view(t, hq + hk, d),
        cos,
        sin,
        [(i, i + rot // 2) for i in range(rot // 2)],
    )
    torch.testing.assert_close(qk.double(), want, **_tol(dtype))
    # Unrotated channels and the values are untouched, bit for bit.
    assert torch.equal(qk[..., rot:], before[:, : (hq + hk) * d].view(t, hq + hk, d)[..., rot:])
    assert torch.equal(qkv[:, (hq + hk) * d :], before[:, (hq + hk) * d :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extra", [0, 8])
def test_apply_rotary_interleaved_writes_pairs_de_interleaved(dtype, extra):
    t, h, rot = 4, 3, 8
    x = _randn(t, h, rot + extra, dtype=dtype, seed=14)
    before = x.clone()
    cos, sin = _cos_sin(t, rot // 2, dtype, seed=15)
    got = apply_rotary_interleaved(x[:, :, :], cos, sin)
    assert got.is_contiguous() and got.shape == x.shape
    want = _rotate_ref(x, cos, sin, [(2 * i, 2 * i + 1) for i in range(rot // 2)])
    torch.testing.assert_close(got.double(), want, **_tol(dtype))
    assert torch.equal(got[..., rot:], x[..., rot:])
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_equals_transformers(dtype):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb_interleave,
    )
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    t, d = 6, 16
    cos_h, sin_h = _cos_sin(t, d // 2, dtype, seed=16)
    # transformers takes cos/sin over the whole head: each half repeated.
    cos_full = torch.cat([cos_h, cos_h], dim=-1).transpose(0, 1)[None]
    sin_full = torch.cat([sin_h, sin_h], dim=-1).transpose(0, 1)[None]
    q = _randn(t, 4, d, dtype=dtype, seed=17)
    k = _randn(t, 2, d, dtype=dtype, seed=18)
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_full[0], sin_full[0], 1
    )
    assert torch.equal(apply_rotary_(q.clone(), cos_h, sin_h), hf_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary_(k.clone(), cos_h, sin_h), hf_k[0].transpose(0, 1))
    hf_q, hf_k = apply_rotary_pos_emb_interleave(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_full[0], sin_full[0], 1
    )
    assert torch.equal(apply_rotary_interleaved(q, cos_h, sin_h), hf_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary_interleaved(k, cos_h, sin_h), hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cos_sin_table_matches_float64_and_transformers(dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": "default", "rope_theta": 10000.0}
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the table takes the model dtype, as in build_model
    try:
        rope = RotaryEmbedding(32, params, 512)
    finally:
        torch.set_default_dtype(prev)
    assert rope.cos_sin_cache.dtype == dtype and rope.cos_sin_cache.shape == (512, 32)
    positions = torch.tensor([0, 1, 7, 300, 511, 3])
    cos, sin = rope.cos_sin(positions)
    assert cos.shape == sin.shape == (6, 1, 16)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32))
    ang = positions.double()[:, None, None] * inv
    # The angle itself is formed in float32 (as transformers forms it): allow its rounding.
    tol = {"rtol": 0, "atol": 1e-4} if dtype == torch.float32 else _tol(dtype)
    torch.testing.assert_close(cos.double(), torch.cos(ang), **tol)
    torch.testing.assert_close(sin.double(), torch.sin(ang), **tol)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, rope_parameters=params)
    hf_cos, hf_sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=dtype), positions[None])
    assert torch.equal(cos[:, 0], hf_cos[0, :, :16]) and torch.equal(sin[:, 0], hf_sin[0, :, :16])


def test_in_place_rotation_is_refused_for_interleaved_rotary():
    rope = RotaryEmbedding(8, {"rope_type": "default"}, 16, interleaved=True)
    cos, sin = rope.cos_sin(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="in place"):
        rope.rotate_(torch.zeros(2, 1, 8), cos, sin)


# -- merged projections ------------------------------------------------------------------------------


def test_merged_linear_equals_its_parts():
    g = torch.Generator().manual_seed(19)
    merged = MergedLinear(12, [("q_proj", 8), ("k_proj", 4), ("v_proj", 4)], bias=True).double()
    parts = {
        "q_proj": torch.nn.Linear(12, 8).double(),
        "k_proj": torch.nn.Linear(12, 4).double(),
        "v_proj": torch.nn.Linear(12, 4).double(),
    }
    slices = dict(merged.checkpoint_slices())
    assert list(slices) == [
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "q_proj.bias",
        "k_proj.bias",
        "v_proj.bias",
    ]
    with torch.no_grad():
        for name, lin in parts.items():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g, dtype=torch.float64))
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=g, dtype=torch.float64))
            slices[f"{name}.weight"].copy_(lin.weight)
            slices[f"{name}.bias"].copy_(lin.bias)
    x = torch.randn(5, 12, generator=g, dtype=torch.float64)
    for got, lin in zip(merged.split(merged(x)), parts.values(), strict=True):
        torch.testing.assert_close(got, lin(x), rtol=1e-12, atol=1e-12)
    assert F.linear(x, merged.weight).shape == (5, 16)


def test_the_model_layer_applies_an_implementation_and_never_chooses_one():
    """``auto`` is decided in engine selection; a model only takes ``torch`` or ``triton``."""
    from backplane.engine.selection import select_backends_for
    from backplane.models.presets import build_preset

    check_fused_ops("torch", "cpu")
    backends = select_backends_for({"attention": "torch"}, ["attention"], device="cpu")
    lm = build_preset("tiny-llama", backends=backends).model
    with pytest.raises(ConfigError) as err:
        lm.set_fused_ops("auto")
    assert str(err.value) == (
        "fused_ops: expected one of torch, triton, got 'auto'; an 'auto' setting is resolved "
        "by backplane.engine.selection.select_fused_ops"
    )
    assert lm.set_fused_ops("torch") == "torch"
    assert {
        m.fused_ops for m in lm.modules() if isinstance(getattr(type(m), "fused_ops", None), str)
    } == {"torch"}
