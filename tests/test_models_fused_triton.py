"""The Triton kernels of the fused model functions against the torch functions and float64.

Every kernel of :mod:`backplane.kernels.elementwise` is checked on every
element, in float32 and bfloat16, over several token counts (0 included),
widths (powers of two and not) and strided inputs, with output buffers
poisoned with NaN beforehand:

* against the same arithmetic in float64 on the same (upcast) inputs, within a
  few units in the last place of the dtype;
* against the torch function of :mod:`backplane.models.fused` it replaces:
  **bit for bit** where the kernel performs the same rounded operations on the
  same elements in the same order (the rotary rotations, ReLU and ReLU²-and-mul,
  the residual sum of the add + norm); where it cannot, within the rounding
  steps that follow the difference: a norm's mean square is a reduction whose
  summation order differs (a few float32 units in the last place; in 16-bit
  dtypes few elements may differ at all, see ``_near_torch``), and exp/erf/tanh
  (SiLU, GELU) come from another math library (a bound from the roundings).

Then whole tiny models (the presets of four architectures) give the same logits
with ``fused_ops="triton"`` as with ``"torch"``, the kernels having run.

On a machine without CUDA the checks run in the Triton interpreter, which must
be switched on before ``triton`` is first imported and would make the Triton
backends available to every other test of the process: so they run in ONE
child process (this file executed as a script with ``TRITON_INTERPRET=1``),
at small shapes, and each pytest test reports one check's result. Run one by
hand with::

    TRITON_INTERPRET=1 python tests/test_models_fused_triton.py rotary

The same checks run in-process on a CUDA device, at larger shapes, in the
tests marked ``gpu``.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from interpreter_checks import interpreter_tests, interpreting, main

ROOT = Path(__file__).resolve().parents[1]

KERNEL_CHECKS = (
    "rms_norm",
    "add_rms_norm",
    "gated_rms_norm",
    "act_and_mul",
    "activation",
    "rotary",
    "rotary_interleaved",
    "head_norm_rotary",
    "gemv",
    "gemv_epilogues",
    "row_parallel",
)
MODEL_CHECKS = (
    "model:tiny-llama",
    "model:tiny-qwen3",
    "model:tiny-nemotron-h",
    "model:tiny-qwen3-next",
    "model:tiny-deepseek-v3",
)
CHECKS = KERNEL_CHECKS + MODEL_CHECKS


# -- the pytest side ----------------------------------------------------------------

if __name__ != "__main__":
    import pytest

    from backplane.core.errors import ConfigError
    from backplane.engine.selection import select_fused_ops

    interpret_results, test_in_interpreter = interpreter_tests(__file__, CHECKS, timeout=900)

    @pytest.mark.gpu
    @pytest.mark.parametrize("check", CHECKS)
    def test_on_gpu(check):
        """One check, run on a CUDA device at larger shapes."""
        pytest.importorskip("triton", reason="triton is not installed")
        if interpreting():
            pytest.skip("TRITON_INTERPRET is set: the kernels would not run on the GPU")
        run_check(check, torch.device("cuda"))

    def test_auto_is_torch_on_cpu_and_triton_there_is_refused():
        """Without CUDA (and outside the interpreter) ``auto`` means torch and ``triton`` is an error."""
        if interpreting():
            pytest.skip("TRITON_INTERPRET is set: the Triton kernels run on the CPU")
        from backplane.models.presets import build_preset

        lm = build_preset("tiny-llama", backends=_torch_backends(("attention",))).model
        assert lm.set_fused_ops(select_fused_ops("auto", "cpu")) == "torch"
        assert lm.set_fused_ops("torch") == "torch"
        with pytest.raises(ConfigError, match="fused_ops=triton cannot run on device 'cpu'") as err:
            lm.set_fused_ops("triton")
        assert "set fused_ops to auto or torch" in str(err.value)
        assert all(m.fused_ops == "torch" for m in _fused_modules(lm))

    def test_engine_applies_the_setting_and_refuses_triton_on_cpu():
        """The engine hands ``fused_ops`` to its model; ``triton`` on a CPU engine is a ConfigError."""
        if interpreting():
            pytest.skip("TRITON_INTERPRET is set: the Triton kernels run on the CPU")
        from backplane.engine.config import EngineConfig
        from backplane.engine.engine import Engine

        cfg = EngineConfig(model="tiny-llama", device="cpu", max_num_seqs=2, max_num_tokens=16)
        with pytest.raises(ConfigError, match="fused_ops=triton cannot run"):
            Engine(cfg.merge(fused_ops="triton"))
        engine = Engine(cfg.merge(fused_ops="auto"))
        assert engine.model.fused_ops == "torch"

    @pytest.mark.gpu
    def test_auto_on_cuda_sets_triton_on_every_layer():
        """On CUDA ``auto`` chooses the kernels for every module that takes a choice; torch undoes it."""
        pytest.importorskip("triton", reason="triton is not installed")
        from backplane.models.presets import build_preset

        lm = build_preset(
            "tiny-qwen3-next",
            device="cuda",
            backends=_torch_backends(("attention", "ssm", "delta")),
        ).model
        mods = _fused_modules(lm)
        assert {type(m).__name__ for m in mods} >= {
            "RMSNorm",
            "GatedRMSNorm",
            "MLP",
            "RotaryEmbedding",
        }
        assert lm.set_fused_ops(select_fused_ops("auto", "cuda")) == "triton"
        assert all(m.fused_ops == "triton" for m in mods)
        assert lm.set_fused_ops("torch") == "torch"
        assert all(m.fused_ops == "torch" for m in mods)

    def test_torch_choice_and_unknown_tensors_never_reach_the_kernels(monkeypatch):
        """``fused_ops="torch"`` (the default) runs the torch ops without importing the kernels."""
        from backplane.models import fused

        def fail() -> Any:
            raise AssertionError("the kernels were loaded")

        monkeypatch.setattr(fused, "load_kernels", fail)
        monkeypatch.setattr(fused, "_KERNELS", None)
        x = torch.randn(3, 8)
        w = torch.ones(8)
        assert torch.equal(fused.rms_norm(x, w, 1e-6), fused.rms_norm(x, w, 1e-6))
        fused.silu_and_mul(x)
        fused.fused_add_rms_norm(x, x, w, 1e-6)


# -- the checks (both sides) ----------------------------------------------------------------


def _fused_modules(lm: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in lm.modules() if isinstance(getattr(type(m), "fused_ops", None), str)]


def _torch_backends(families: tuple[str, ...]) -> dict[str, Any]:
    from backplane.core.registry import get_registry
    from backplane.testing.plugin import load_backend

    registry = get_registry()
    return {fam: load_backend(registry.get(fam, "torch")) for fam in families}


DTYPES = (torch.float32, torch.bfloat16)


def _kernels():
    from backplane.models.fused import load_kernels

    return load_kernels()


def _small(device: torch.device) -> bool:
    """The interpreter runs every program in Python: keep its shapes small."""
    return device.type == "cpu"


def _tokens(device: torch.device) -> tuple[int, ...]:
    return (0, 1, 7, 33) if _small(device) else (0, 1, 7, 33, 64)


def _shapes(device: torch.device, widths: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(tokens, width)`` pairs: every pair on a GPU; in the interpreter each token
    count and each width at least once (and the most tokens with a width not a
    power of two), which keeps the child process short."""
    tokens = _tokens(device)
    if not _small(device):
        return [(t, w) for t in tokens for w in widths]
    n = max(len(tokens), len(widths))
    pairs = [(tokens[i % len(tokens)], widths[i % len(widths)]) for i in range(n)]
    return pairs + [(tokens[-1], widths[1]), (tokens[1], widths[-1])]


def _widths(device: torch.device) -> tuple[int, ...]:
    return (64, 96, 1536, 2048) if _small(device) else (64, 96, 1536, 2048, 4096, 8192)


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device, dtype)


def _strided_rows(t: int, d: int, *, dtype, device, seed: int, scale: float = 1.0):
    """A ``[t, d]`` view whose rows are strided (columns 3 .. 3 + d of a wider tensor)."""
    wide = _randn(t, d + 5, dtype=dtype, device=device, seed=seed, scale=scale)
    return wide[:, 3 : 3 + d]


def _poison(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    """Against float64: a few units in the last place of ``dtype``, plus a small absolute slack."""
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-6}
    return {"rtol": 2**-6, "atol": 2**-8}


def _near_torch(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """A norm against its torch function, whose mean square is summed in another order.

    The float32 statistics differ in their last bits, which moves a result to the
    neighbouring value of its dtype only where it lies next to a rounding
    boundary: in float32 every element may be a few units in the last place
    off; in 16-bit dtypes at most 1% of the elements (plus two) may differ at
    all, each by at most the roundings after the statistic (the normalised
    value, its scaled product, the gate's product: one unit each, on both sides).
    """
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    if want.dtype == torch.float32:
        _close(name, got, want, {"rtol": 4e-6, "atol": 1e-6})
        return
    _close(name, got, want, {"rtol": 6 * _unit(want.dtype), "atol": 1e-5})
    differ = int((got != want).sum())
    assert differ <= 0.01 * got.numel() + 2, (
        f"{name}: {differ} of {got.numel()} elements differ from the torch function"
    )


def _unit(dtype: torch.dtype) -> float:
    """The unit roundoff of ``dtype`` (half its machine epsilon)."""
    return torch.finfo(dtype).eps / 2


def _within(name: str, got: torch.Tensor, want64: torch.Tensor, bound: torch.Tensor) -> None:
    """``|got - want64| <= bound`` on every element (a bound from the rounding steps taken)."""
    assert got.shape == want64.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want64.shape)}"
    err = (got.double() - want64).abs().cpu()
    bound = bound.double().cpu() + 1e-30
    bad = ~(err <= bound)
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} of {got.numel()} elements beyond the rounding bound; "
        f"worst error {float((err / bound).max()):.3g} x its bound"
    )


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: dict[str, float]) -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(
        got.double().cpu(), want.double().cpu(), **tol, msg=lambda m: f"{name}: {m}"
    )


def _equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (got != want).sum().item()
    assert diff == 0, f"{name}: {diff} of {got.numel()} elements differ from the torch function"


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    x64 = x.double()
    normed = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return normed * ((1.0 + w.double()) if zero_centered else w.double())


def _silu64(t: torch.Tensor) -> torch.Tensor:
    return t / (1 + torch.exp(-t))


ACT_REFS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": _silu64,
    "relu": lambda t: torch.clamp(t, min=0),
    "relu2": lambda t: torch.clamp(t, min=0) ** 2,
    "gelu": lambda t: 0.5 * t * (1 + torch.erf(t / math.sqrt(2))),
    "gelu_tanh": lambda t: (
        0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t**3)))
    ),
}
#: activations whose kernel repeats torch's arithmetic exactly (no transcendental function)
EXACT_ACTS = ("relu", "relu2")


def check_rms_norm(device: torch.device) -> None:
    """Rows of very different scales, strided rows and q-norm-like ``[T, H, d]`` views."""
    from backplane.models.fused import rms_norm

    k = _kernels()
    for dtype in DTYPES:
        for t, d in _shapes(device, _widths(device)):
            for zc in (False, True):
                name = f"rms_norm {dtype} T={t} D={d} zero_centered={zc}"
                x = _strided_rows(t, d, dtype=dtype, device=device, seed=t * 7 + d, scale=2.0)
                x = x * torch.logspace(-2, 2, t, device=device)[:, None].to(dtype)
                w = _randn(d, dtype=dtype, device=device, seed=d, scale=0.5)
                if not zc:
                    w = w + 1
                before = x.clone()
                out = k._rms_norm_eager(x, w, 1e-6, zc, out=_poison(x.shape, dtype, device))
                assert torch.equal(x, before), f"{name}: input modified"
                _close(name, out, _rms_ref(x, w, 1e-6, zc), _tol(dtype))
                _near_torch(name + " vs torch", out, rms_norm(x, w, 1e-6, zc))
                assert out.dtype == rms_norm(x, w, 1e-6, zc).dtype
        # per-head norms over strided [T, H, d] views of a fused projection output
        t, h, d = 5, 6, 96
        qkv = _randn(t, (h + 4) * d, dtype=dtype, device=device, seed=3)
        q = qkv[:, : h * d].view(t, h, d)
        w = _randn(d, dtype=dtype, device=device, seed=4) + 1
        got = k.rms_norm(q, w, 1e-6, False)
        _close(f"rms_norm {dtype} [T, H, d] view", got, _rms_ref(q, w, 1e-6, False), _tol(dtype))
        # weight in float32 under bfloat16 activations: the promotion of the torch function
        if dtype != torch.float32:
            wf = w.float()
            got = k.rms_norm(q, wf, 1e-6, False)
            want = rms_norm(q, wf, 1e-6, False)
            assert got.dtype == want.dtype == torch.float32
            _near_torch(f"rms_norm {dtype} float32 weight vs torch", got, want)


def check_add_rms_norm(device: torch.device) -> None:
    """One kernel writes the normed rows and the new residual; the residual bit for bit."""
    from backplane.models.fused import fused_add_rms_norm

    k = _kernels()
    for dtype in DTYPES:
        for t, d in _shapes(device, _widths(device)):
            for zc in (False, True):
                name = f"add_rms_norm {dtype} T={t} D={d} zero_centered={zc}"
                x = _strided_rows(t, d, dtype=dtype, device=device, seed=t + d)
                res = _randn(t, d, dtype=dtype, device=device, seed=t + d + 1, scale=4.0)
                w = _randn(d, dtype=dtype, device=device, seed=d + 2, scale=0.5)
                x_before, res_before = x.clone(), res.clone()
                out, new_res = k._add_rms_norm_eager(
                    x,
                    res,
                    w,
                    1e-6,
                    zc,
                    out=_poison(x.shape, dtype, device),
                    res_out=_poison(x.shape, dtype, device),
                )
                assert torch.equal(x, x_before) and torch.equal(res, res_before), (
                    f"{name}: input modified"
                )
                want_out, want_res = fused_add_rms_norm(x, res, w, 1e-6, zc)
                _equal(name + " residual", new_res, want_res)
                _close(name + " residual", new_res, x.double() + res.double(), _tol(dtype))
                _close(name, out, _rms_ref(want_res, w, 1e-6, zc), _tol(dtype))
                _near_torch(name + " vs torch", out, want_out)


def _gated_ref(x, z, w, eps, group, norm_before_gate):
    x64, gate = x.double(), _silu64(z.double())
    if not norm_before_gate:
        x64 = x64 * gate
    g = x64.unflatten(-1, (-1, group))
    g = g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    out = g.flatten(-2) * w.double()
    return out * gate if norm_before_gate else out


def check_gated_rms_norm(device: torch.device) -> None:
    """Both gate orders, one group and several, ``[T, H, d]`` inputs with a strided gate."""
    from backplane.models.fused import gated_rms_norm

    k = _kernels()
    widths = (64, 96, 512) if _small(device) else (64, 96, 512, 4096, 8192)
    for dtype in DTYPES:
        for t, d in _shapes(device, widths):
            for nbg, groups in ((True, 1), (False, 1), (False, 4), (True, 2)):
                group = d // groups
                name = f"gated_rms_norm {dtype} T={t} D={d} groups={groups} nbg={nbg}"
                x = _randn(t, d, dtype=dtype, device=device, seed=d + t, scale=2.0)
                z = _strided_rows(t, d, dtype=dtype, device=device, seed=d + t + 1, scale=3.0)
                w = _randn(d, dtype=dtype, device=device, seed=d + 2, scale=0.5) + 1
                want = gated_rms_norm(x, z, w, 1e-5, group, nbg)
                out = k._gated_rms_norm_eager(
                    x, z, w, 1e-5, group, nbg, out=_poison(x.shape, want.dtype, device)
                )
                _close(name, out, _gated_ref(x, z, w, 1e-5, group, nbg), _tol(dtype))
                _near_torch(name + " vs torch", out, want)
        # the delta mixer's layout: [T, heads, head_dim], a strided gate of the same shape
        t, h, d = 6, 4, 32
        x = _randn(t, h, d, dtype=dtype, device=device, seed=11)
        zw = _randn(t, h, 2 * d, dtype=dtype, device=device, seed=12)
        z = zw[..., d:]
        w = _randn(d, dtype=dtype, device=device, seed=13) + 1
        got = k.gated_rms_norm(x, z, w, 1e-6, d, True)
        want = gated_rms_norm(x, z, w, 1e-6, d, True)
        _close(
            f"gated_rms_norm {dtype} [T, H, d]",
            got,
            _gated_ref(x, z, w, 1e-6, d, True),
            _tol(dtype),
        )
        _near_torch(f"gated_rms_norm {dtype} [T, H, d] vs torch", got, want)
    # float32 input (an SSM output) with a bfloat16 weight: the result is promoted
    x = _randn(5, 64, dtype=torch.float32, device=device, seed=14)
    z = _randn(5, 64, dtype=torch.bfloat16, device=device, seed=15)
    w = (_randn(64, dtype=torch.float32, device=device, seed=16) + 1).to(torch.bfloat16)
    for nbg in (False, True):
        got = k.gated_rms_norm(x, z, w, 1e-5, 16, nbg)
        want = gated_rms_norm(x, z, w, 1e-5, 16, nbg)
        assert got.dtype == want.dtype == torch.float32, (got.dtype, want.dtype)
        _near_torch(f"gated_rms_norm mixed dtypes nbg={nbg} vs torch", got, want)


def check_act_and_mul(device: torch.device) -> None:
    """Every gated activation over a ``[gate | up]`` row (strided rows)."""
    from backplane.models.fused import act_and_mul, gelu_tanh, relu_squared

    fns = {"silu": F.silu, "relu": F.relu, "relu2": relu_squared, "gelu": F.gelu}
    fns["gelu_tanh"] = gelu_tanh
    k = _kernels()
    inter = (32, 48, 1536) if _small(device) else (32, 48, 1536, 5632, 14336)
    for dtype in DTYPES:
        for t, i in _shapes(device, inter):
            for act, fn in fns.items():
                name = f"act_and_mul {act} {dtype} T={t} I={i}"
                x = _strided_rows(t, 2 * i, dtype=dtype, device=device, seed=i + t, scale=3.0)
                out = k._act_eager(x, act, True, out=_poison((t, i), dtype, device))
                g, up = x.double()[:, :i], x.double()[:, i:]
                want64 = ACT_REFS[act](g) * up
                # two roundings to dtype (act, product), and the float32
                # activation's own error, which near a cancellation (GELU
                # for negative inputs) is absolute, of the size of the input
                slack = 8 * _unit(torch.float32) * g.abs() * up.abs()
                _within(name, out, want64, 4 * _unit(dtype) * want64.abs() + slack)
                want = act_and_mul(x, fn)
                if act in EXACT_ACTS:
                    _equal(name, out, want)
                else:
                    # exp/erf/tanh of another math library: the same bound around torch's
                    _within(
                        name + " vs torch",
                        out,
                        want.double(),
                        4 * _unit(dtype) * want.double().abs() + slack,
                    )
        # a leading shape of two dimensions
        x = _randn(2, 3, 64, dtype=dtype, device=device, seed=5)
        _equal(
            "act_and_mul relu2 [2, 3, 64]", k.act_and_mul(x, "relu2"), act_and_mul(x, relu_squared)
        )


def check_activation(device: torch.device) -> None:
    """Non-gated activations (Nemotron-H's ReLU²) over strided rows."""
    from backplane.models.fused import relu_squared

    k = _kernels()
    for dtype in DTYPES:
        for t, d in _shapes(device, (64, 96, 1536)):
            for act in ("relu2", "silu"):
                name = f"activation {act} {dtype} T={t} D={d}"
                x = _strided_rows(t, d, dtype=dtype, device=device, seed=d + t, scale=3.0)
                out = k._act_eager(x, act, False, out=_poison((t, d), dtype, device))
                want64 = ACT_REFS[act](x.double())
                slack = 8 * _unit(torch.float32) * x.double().abs()
                _within(name, out, want64, 2 * _unit(dtype) * want64.abs() + slack)
                if act == "relu2":
                    _equal(name, out, relu_squared(x))
                else:
                    want = F.silu(x).double()
                    _within(name + " vs torch", out, want, 2 * _unit(dtype) * want.abs() + slack)


def _cos_sin(t: int, h: int, dtype, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` laid out as :meth:`RotaryEmbedding.cos_sin` hands them out (strided views)."""
    ang = _randn(t, h, dtype=torch.float64, device=device, seed=seed, scale=3.0)
    table = torch.cat([torch.cos(ang), torch.sin(ang)], dim=-1).to(dtype)
    cos, sin = table.unsqueeze(1).chunk(2, dim=-1)
    return cos, sin


def _rotate_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64, one channel pair at a time; the pair's outputs go to ``(i, i + h)``.

    :return: ``(rotated, bound)``: the bound on the error of the rotation done
        with roundings to ``x.dtype`` (each product, then the sum: the unit
        roundoff times the products' magnitudes, twice, and times the result).
    """
    x64, c, s = x.double(), cos.double(), sin.double()
    h = cos.shape[-1]
    out = x64.clone()
    bound = torch.zeros_like(x64)
    for i, (a, b) in enumerate(pairs):
        xa, xb = x64[..., a], x64[..., b]
        out[..., i] = xa * c[..., i] - xb * s[..., i]
        out[..., i + h] = xb * c[..., i] + xa * s[..., i]
        mag = (xa * c[..., i]).abs() + (xb * s[..., i]).abs()
        bound[..., i] = 2 * mag + out[..., i].abs()
        mag = (xb * c[..., i]).abs() + (xa * s[..., i]).abs()
        bound[..., i + h] = 2 * mag + out[..., i + h].abs()
    return out, bound * _unit(x.dtype)


def check_head_norm_rotary(device: torch.device) -> None:
    """Per-head norms (query and key weights) and the rotation of a fused qkv output in one
    launch, in place: against float64 and the torch function; the values untouched."""
    from backplane.models.fused import head_norm_rotary_

    k = _kernels()
    heads = ((4, 2, 64), (3, 1, 96), (2, 2, 16))
    if not _small(device):
        heads += ((32, 8, 128), (16, 4, 128))
    for dtype in DTYPES:
        for t in _tokens(device):
            for hq, hk, d in heads:
                for zc in (False, True):
                    name = f"head_norm_rotary {dtype} T={t} heads={hq}+{hk} d={d} zc={zc}"
                    seed = t + d + hq
                    qkv = _randn(t, (hq + 2 * hk) * d, dtype=dtype, device=device, seed=seed)
                    qkv = qkv * torch.logspace(-2, 2, max(t, 1), device=device)[:t, None].to(dtype)
                    wq = _randn(d, dtype=dtype, device=device, seed=seed + 1, scale=0.5)
                    wk = _randn(d, dtype=dtype, device=device, seed=seed + 2, scale=0.5)
                    if not zc:
                        wq, wk = wq + 1, wk + 1
                    cos, sin = _cos_sin(t, d // 2, dtype, device, seed=seed + 3)
                    before = qkv.clone()
                    torch_out = qkv.clone()
                    qk = qkv[:, : (hq + hk) * d].view(t, hq + hk, d)
                    assert k.head_norm_rotary_(qk, hq, wq, wk, 1e-6, zc, cos, sin) is qk
                    head_norm_rotary_(
                        torch_out[:, : (hq + hk) * d].view(t, hq + hk, d),
                        hq, wq, wk, 1e-6, zc, cos, sin,
                    )  # fmt: skip
                    _near_torch(name + " vs torch", qkv, torch_out)
                    src = before[:, : (hq + hk) * d].view(t, hq + hk, d)
                    normed = torch.cat(
                        [_rms_ref(src[:, :hq], wq, 1e-6, zc), _rms_ref(src[:, hq:], wk, 1e-6, zc)],
                        dim=1,
                    )
                    pairs = [(i, i + d // 2) for i in range(d // 2)]
                    want, bound = _rotate_ref(normed, cos, sin, pairs)
                    # the rotation's bound, widened for the norm's roundings (two in the
                    # dtype, and the float32 mean square) on each product it feeds
                    unit = _unit(dtype) / _unit(torch.float64)  # normed is float64
                    _within(name, qk, want, 8 * unit * bound)
                    assert torch.equal(qkv[:, (hq + hk) * d :], before[:, (hq + hk) * d :]), (
                        f"{name}: values modified"
                    )
    x = torch.zeros(1, 2, 8, dtype=torch.bfloat16, device=device)
    cos, sin = _cos_sin(1, 4, torch.bfloat16, device, seed=0)
    w32 = torch.ones(8, device=device)
    try:
        head_norm_rotary_(x, 1, w32, w32, 1e-6, False, cos, sin, fused_ops="triton")
    except ValueError:
        pass
    else:
        raise AssertionError("head_norm_rotary_ wrote float32 norms into bfloat16 heads")


def check_rotary(device: torch.device) -> None:
    """Queries and keys of a fused qkv output rotated in one launch, in place; values untouched."""
    from backplane.models.fused import apply_rotary_

    k = _kernels()
    heads = ((4, 2, 64, 64), (4, 2, 64, 32), (3, 1, 96, 96), (2, 2, 16, 4))
    if not _small(device):
        heads += ((32, 8, 128, 128), (16, 2, 256, 64))
    for dtype in DTYPES:
        for t in _tokens(device):
            for hq, hk, d, rot in heads:
                name = f"rotary {dtype} T={t} heads={hq}+{hk} d={d} rot={rot}"
                qkv = _randn(t, (hq + 2 * hk) * d, dtype=dtype, device=device, seed=t + d + rot)
                cos, sin = _cos_sin(t, rot // 2, dtype, device, seed=t + rot)
                before = qkv.clone()
                torch_out = qkv.clone()
                qk = qkv[:, : (hq + hk) * d].view(t, hq + hk, d)  # rows strided: v follows
                assert k.rotary_(qk, cos, sin) is qk
                apply_rotary_(torch_out[:, : (hq + hk) * d].view(t, hq + hk, d), cos, sin)
                _equal(name, qkv, torch_out)
                pairs = [(i, i + rot // 2) for i in range(rot // 2)]
                want, bound = _rotate_ref(
                    before[:, : (hq + hk) * d].view(t, hq + hk, d), cos, sin, pairs
                )
                _within(name, qk, want, bound)
                assert torch.equal(qkv[:, (hq + hk) * d :], before[:, (hq + hk) * d :]), (
                    f"{name}: values modified"
                )
        # queries alone, heads strided inside each row (an output-gated projection)
        t, h, d = 5, 3, 32
        qg = _randn(t, h, 2 * d, dtype=dtype, device=device, seed=9)
        q, ref = qg[..., :d], qg.clone()
        cos, sin = _cos_sin(t, d // 2, dtype, device, seed=10)
        k.rotary_(q, cos, sin)
        apply_rotary_(ref[..., :d], cos, sin)
        _equal(f"rotary {dtype} strided heads", qg, ref)


def check_rotary_interleaved(device: torch.device) -> None:
    """Pairs ``(2i, 2i+1)`` of a strided view, written de-interleaved into a poisoned buffer."""
    from backplane.models.fused import apply_rotary_interleaved

    k = _kernels()
    for dtype in DTYPES:
        for t in _tokens(device):
            for h, nope, rope, extra in ((4, 16, 8, 0), (3, 32, 64, 0), (2, 8, 8, 6)):
                name = f"rotary_interleaved {dtype} T={t} H={h} rope={rope} extra={extra}"
                q = _randn(t, h, nope + rope + extra, dtype=dtype, device=device, seed=t + rope)
                x = q[..., nope:]  # the rotary part of MLA queries: a strided view
                cos, sin = _cos_sin(t, rope // 2, dtype, device, seed=t + h)
                before = q.clone()
                out = k._rotary_interleaved_eager(x, cos, sin, out=_poison(x.shape, dtype, device))
                assert torch.equal(q, before), f"{name}: input modified"
                _equal(name, out, apply_rotary_interleaved(x, cos, sin))
                pairs = [(2 * i, 2 * i + 1) for i in range(rope // 2)]
                _within(name, out, *_rotate_ref(x, cos, sin, pairs))


_KERNEL_FUNCS = (
    "rms_norm",
    "add_rms_norm",
    "gated_rms_norm",
    "act_and_mul",
    "activation",
    "rotary_",
    "rotary_interleaved",
    "head_norm_rotary_",
)
#: kernels each preset's forward must have run
_EXPECTED_CALLS = {
    "tiny-llama": {"rms_norm", "add_rms_norm", "act_and_mul", "rotary_"},
    "tiny-qwen3": {"rms_norm", "add_rms_norm", "act_and_mul", "head_norm_rotary_"},
    "tiny-nemotron-h": {"rms_norm", "add_rms_norm", "gated_rms_norm", "activation"},
    "tiny-qwen3-next": {"rms_norm", "add_rms_norm", "gated_rms_norm", "act_and_mul", "rotary_"},
    "tiny-deepseek-v3": {"rms_norm", "add_rms_norm", "act_and_mul", "rotary_interleaved"},
}
_PRESET_FAMILIES = {
    "tiny-llama": ("attention",),
    "tiny-qwen3": ("attention",),
    "tiny-nemotron-h": ("attention", "ssm"),
    "tiny-qwen3-next": ("attention", "ssm", "delta"),
    "tiny-deepseek-v3": ("mla",),
}


def _gemv_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, ref: torch.Tensor):
    """The rounding bound of a float32-accumulated row product rounded once to ``x.dtype``.

    The interpreter's casts to 16-bit types truncate instead of rounding: twice the unit there.
    """
    k = x.shape[-1]
    absdot = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    last = _unit(x.dtype) * (2 if x.device.type == "cpu" and x.dtype != torch.float32 else 1)
    return last * ref.abs() + 2 * k * _unit(torch.float32) * absdot


def check_gemv_epilogues(device: torch.device) -> None:
    """The one-row kernel's prologues and epilogues (activations, the gated input, the gated
    output of gate/up, the normed input) against the plain product and torch's ops."""
    from backplane.kernels import load_gemv

    gemv = load_gemv()
    _check_gemv_activations(gemv, device)
    _check_gemv_gated(gemv, device)
    _check_gemv_glu(gemv, device)
    _check_norm_gemv(gemv, device)


def check_gemv(device: torch.device) -> None:
    """The one-row split-K product: every element within its rounding bound of float64, for
    planned and forced launches (splits that do and do not divide ``K``, ragged row blocks),
    with and without bias, from a strided row; repeated calls are bit-identical (the arrival
    counters reset); on CUDA, CUDA-graph replays match eager calls and ``Linear`` routes
    one-row inputs through the kernel only where :func:`plan` chooses it."""
    from backplane.kernels import load_gemv

    gemv = load_gemv()
    if _small(device):
        shapes = [(40, 1000), (33, 512), (17, 300), (64, 2048)]
        launches = [None, (16, 256, 1), (8, 64, 4), (16, 128, 3)]
        dtypes = (torch.float32, torch.bfloat16)
    else:
        shapes = [(2048, 8192), (2048, 4096), (3072, 2048), (10304, 2048), (5, 7), (33, 3000)]
        launches = [None, (16, 256, 1), (8, 512, 1), (16, 256, 4), (8, 64, 3), (32, 128, 8)]
        dtypes = (torch.float32, torch.bfloat16, torch.float16)
    seed = 0
    for (n, k), dtype, launch in itertools.product(shapes, dtypes, launches):
        seed += 1
        x = _strided_rows(1, k, dtype=dtype, device=device, seed=seed)
        w = _randn(n, k, dtype=dtype, device=device, seed=seed + 1000, scale=k**-0.5)
        b = _randn(n, dtype=dtype, device=device, seed=seed + 2000)
        for bias in (None, b):
            name = f"gemv {n}x{k} {dtype} launch={launch} bias={bias is not None}"
            got = gemv.gemv(x, w, bias, launch=launch)
            assert got.shape == (1, n) and got.dtype == dtype, name
            ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
            _within(name, got, ref, _gemv_bound(x, w, bias, ref))
            _equal(name + " (again)", gemv.gemv(x, w, bias, launch=launch), got)
    w = _randn(4, 8, dtype=torch.float32, device=device, seed=1)
    for bad in ((2, 8), (1, 1, 8), (1, 9)):
        try:
            gemv.gemv(torch.zeros(bad, device=device), w)
        except ValueError:
            continue
        raise AssertionError(f"gemv accepted an input of shape {bad} for a 4x8 weight")
    _check_linear_follows_its_weight(gemv, device)
    _check_gemv_dependent_launch(gemv, device)
    if device.type != "cuda":
        return
    from backplane.models.linear import Linear

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for n, k in ((2048, 8192), (2048, 2048), (16384, 2048)):
        lin = Linear(k, n, bias=True).to(device, torch.bfloat16)
        lin.fused_ops = "triton"
        x = _randn(1, k, dtype=torch.bfloat16, device=device, seed=n + k)
        with torch.inference_mode():
            got = lin(x)
            planned = gemv.plan(n, k, sms)
            if planned is None:
                _equal(f"Linear {n}x{k} (cuBLAS)", got, F.linear(x, lin.weight, lin.bias))
            else:
                _equal(
                    f"Linear {n}x{k} (kernel)",
                    got,
                    gemv.gemv(x, lin.weight, lin.bias, launch=planned),
                )
            x2 = _randn(2, k, dtype=torch.bfloat16, device=device, seed=7)
            _equal(f"Linear {n}x{k} two rows", lin(x2), F.linear(x2, lin.weight, lin.bias))
    from backplane.models.mlp import MLP

    mlp = MLP(2048, 8192, act="relu2", gated=False).to(device, torch.bfloat16)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(_randn(*p.shape, dtype=p.dtype, device=device, seed=p.numel(), scale=0.02))
    mlp.fused_ops = mlp.up_proj.fused_ops = mlp.down_proj.fused_ops = "triton"
    x = _randn(1, 2048, dtype=torch.bfloat16, device=device, seed=11)
    with torch.inference_mode():
        # The epilogue against the projection stored and activated by torch.
        want = mlp.down_proj(torch.square(F.relu(mlp.up_proj(x))))
        _equal("MLP relu2, one row (activation in the up projection)", mlp(x), want)
    gated = MLP(2048, 8192, act="silu", gated=True).to(device, torch.bfloat16)
    with torch.no_grad():
        for p in gated.parameters():
            p.copy_(_randn(*p.shape, dtype=p.dtype, device=device, seed=p.numel(), scale=0.02))
    gated.fused_ops = gated.gate_up_proj.fused_ops = gated.down_proj.fused_ops = "triton"
    with torch.inference_mode():
        from backplane.kernels import load

        gate_up = gated.gate_up_proj(x)
        want = gated.down_proj(load().act_and_mul(gate_up, "silu"))
        _equal("MLP silu gated, one row (gated product in the down projection)", gated(x), want)
    # Captured with one input, replayed with others: the counters left at zero by
    # each launch let every replay merge its own partials.
    w = _randn(2048, 8192, dtype=torch.bfloat16, device=device, seed=3, scale=8192**-0.5)
    static_x = torch.zeros(1, 8192, dtype=torch.bfloat16, device=device)
    launch = (16, 256, 4)
    gemv.gemv(static_x, w, launch=launch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = gemv.gemv(static_x, w, launch=launch)
    for s in range(3):
        x = _randn(1, 8192, dtype=torch.bfloat16, device=device, seed=100 + s)
        static_x.copy_(x)
        graph.replay()
        _equal(f"gemv graph replay {s}", static_y.clone(), gemv.gemv(x, w, launch=launch))


def check_row_parallel(device: torch.device) -> None:
    """A row-parallel projection at one row runs the one-row kernel for its partial product
    (plain, and with the gated product as its input) and then sums over the ranks and adds
    the bias once: bit for bit the kernel's partial product, reduced, plus the bias; without
    ``reduce`` the bias only on rank 0. Variants whose epilogue or prologue needs the whole
    output or row are not taken. The other rank's partial sum comes from a stand-in group."""
    from dataclasses import dataclass, field

    from backplane.core.parallel import TensorParallel
    from backplane.kernels import load, load_gemv
    from backplane.models.parallel import RowParallelLinear, row_parallel_linear

    gemv, elementwise = load_gemv(), load()

    @dataclass(frozen=True)
    class TwoRanks(TensorParallel):
        other: torch.Tensor | None = None
        reduced: list = field(default_factory=list)

        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            self.reduced.append(x.shape)
            return x.add_(self.other)

    n, k = (40, 256) if _small(device) else (4096, 7168)
    dtype = torch.bfloat16
    for rank, reduce in ((0, True), (1, True), (0, False), (1, False)):
        other = _randn(1, n, dtype=dtype, device=device, seed=60 + rank)
        tp = TwoRanks(rank=rank, size=2, other=other)
        lin = row_parallel_linear(2 * k, n, bias=True, reduce=reduce, tp=tp)
        assert isinstance(lin, RowParallelLinear)
        lin = lin.to(device, dtype)
        with torch.no_grad():
            lin.weight.copy_(_randn(n, k, dtype=dtype, device=device, seed=61, scale=k**-0.5))
            lin.bias.copy_(_randn(n, dtype=dtype, device=device, seed=62))
        lin.fused_ops = "triton"
        x = _randn(1, k, dtype=dtype, device=device, seed=63)
        gate_up = _randn(1, 2 * k, dtype=dtype, device=device, seed=64)
        launch = lin._plan_gemv(x)
        assert launch, "the one-row kernel plans this shape"

        def finish(y: torch.Tensor, rank=rank, reduce=reduce, other=other, bias=lin.bias):
            if not reduce:
                return y + bias if rank == 0 else y
            return y + other + bias

        name = f"row-parallel rank {rank} reduce={reduce}"
        with torch.inference_mode():
            _equal(name, lin(x), finish(gemv.gemv(x, lin.weight, launch=launch)))
            plan = lin._plan_gemv(gate_up, gated=True)
            want = finish(
                gemv.gemv(elementwise.act_and_mul(gate_up, "silu"), lin.weight, launch=plan)
            )
            _equal(name + " gated", lin.forward_gated(gate_up, "silu"), want)
            g = torch.ones(k, dtype=dtype, device=device)
            assert lin.forward_normed(x, None, g, 1e-5, False) is None, name
            assert lin.forward_activated(x, "relu") is None, name
        assert len(tp.reduced) == (2 if reduce else 0), f"{name}: reduced {tp.reduced}"


def _check_gemv_dependent_launch(gemv: Any, device: torch.device) -> None:
    """Projections launched as programmatic dependents (the first two weight tiles loaded before
    the wait) equal the plain launches bit for bit, alone and chained (each reading the
    previous one's output, with a norm prologue, split-K and a gated prologue); on a device
    that runs dependent launches, a captured chain replays with new inputs as the plain chain
    computes them (a missing wait would read the previous replay's rows)."""
    from backplane.core.launch import dependent_launch

    if device.type == "cuda" and not dependent_launch(device.index):
        return
    if _small(device):
        k, n1, n2, launches = 64, 96, 48, ((8, 16, 1), (8, 32, 2), (8, 16, 1))
    else:
        k, n1, n2, launches = 2048, 4096, 2048, ((16, 256, 1), (16, 256, 4), (8, 512, 1))
    g = _randn(k, dtype=torch.bfloat16, device=device, seed=31, scale=0.5)
    w1 = _randn(n1, k, dtype=torch.bfloat16, device=device, seed=32, scale=k**-0.5)
    w2 = _randn(n2, n1, dtype=torch.bfloat16, device=device, seed=33, scale=n1**-0.5)
    w3 = _randn(n2 // 4, n2 // 2, dtype=torch.bfloat16, device=device, seed=34, scale=0.1)
    b2 = _randn(n2, dtype=torch.bfloat16, device=device, seed=35)

    def chain(pdl: bool):
        p1 = gemv.OneRowProjection(w1, launch=launches[0], norm=(g, 1e-6, False), pdl=pdl)
        p2 = gemv.OneRowProjection(w2, b2, launch=launches[1], pdl=pdl)
        p3 = gemv.OneRowProjection(w3, launch=launches[2], gate_act="silu", pdl=pdl)

        def run(x: torch.Tensor, r: torch.Tensor) -> list[torch.Tensor]:
            y1, res = p1(x, r)
            y2, _ = p2(y1)
            y3, _ = p3(y2)
            return [y1, res, y2, y3]

        return run

    plain, dependent = chain(False), chain(True)
    inputs = [
        (
            _randn(1, k, dtype=torch.bfloat16, device=device, seed=40 + s),
            _randn(1, k, dtype=torch.bfloat16, device=device, seed=50 + s),
        )
        for s in range(3)
    ]
    for s, (x, r) in enumerate(inputs):
        for i, (got, want) in enumerate(zip(dependent(x, r), plain(x, r), strict=True)):
            _equal(f"dependent launch, chain {s}, output {i}", got, want)
    if device.type != "cuda":
        return
    static_x, static_r = torch.zeros_like(inputs[0][0]), torch.zeros_like(inputs[0][1])
    dependent(static_x, static_r)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = dependent(static_x, static_r)
    for s, (x, r) in enumerate(inputs):
        static_x.copy_(x)
        static_r.copy_(r)
        graph.replay()
        for i, (got, want) in enumerate(zip(outs, plain(x, r), strict=True)):
            _equal(f"dependent launch, captured chain {s}, output {i}", got.clone(), want)


def _check_linear_follows_its_weight(gemv: Any, device: torch.device) -> None:
    """A ``Linear``'s prepared one-row projection runs the planned launch, and is rebuilt when
    the weight changes (a new parameter, a reload, a move): the new weight is read, not the
    old."""
    from backplane.models.linear import Linear

    n, k = (40, 1000) if _small(device) else (2048, 8192)
    sms = (
        4
        if device.type == "cpu"
        else torch.cuda.get_device_properties(device).multi_processor_count
    )
    lin = Linear(k, n, bias=False).to(device, torch.float32)
    lin.fused_ops = "triton"
    x = _randn(1, k, dtype=torch.float32, device=device, seed=5)
    for seed in (6, 7):
        w = _randn(n, k, dtype=torch.float32, device=device, seed=seed)
        lin.weight = torch.nn.Parameter(w, requires_grad=False)
        with torch.inference_mode():
            got = lin(x)
        want = gemv.gemv(x, lin.weight, launch=gemv.plan(n, k, sms))
        _equal(f"Linear {n}x{k} one row, weight {seed}", got, want)


def _check_gemv_activations(gemv: Any, device: torch.device) -> None:
    """``gemv(..., act=a)`` equals the activation kernel applied to the plain product, bit for
    bit, split or not; ReLU and ReLU² also equal torch's functions of the stored product."""
    from backplane.kernels import load

    elementwise = load()
    if _small(device):
        cases = [((40, 1000), None), ((33, 512), (8, 64, 4))]
    else:
        cases = [((8192, 2048), None), ((2048, 8192), None), ((33, 3000), (8, 64, 3))]
    torch_acts = {"relu": F.relu, "relu2": lambda y: torch.square(F.relu(y))}
    seed = 500
    for ((n, k), launch), dtype in itertools.product(cases, (torch.float32, torch.bfloat16)):
        seed += 1
        x = _randn(1, k, dtype=dtype, device=device, seed=seed)
        w = _randn(n, k, dtype=dtype, device=device, seed=seed + 1, scale=k**-0.5)
        b = _randn(n, dtype=dtype, device=device, seed=seed + 2)
        plain = gemv.gemv(x, w, b, launch=launch)
        for act in ("relu", "relu2", "silu"):
            name = f"gemv {n}x{k} {dtype} launch={launch} act={act}"
            got = gemv.gemv(x, w, b, launch=launch, act=act)
            _equal(name, got, elementwise.activation(plain, act))
            if act in torch_acts:
                _equal(name + " (torch)", got, torch_acts[act](plain))
    try:
        gemv.gemv(x, w, act="tanh")
    except ValueError:
        return
    raise AssertionError("gemv accepted an unknown activation")


def _check_gemv_gated(gemv: Any, device: torch.device) -> None:
    """``gemv(x, ..., gate_act=a)`` over a ``[gate | up]`` row equals the gated activation
    kernel followed by the plain product, bit for bit, split or not; a row that is not twice
    the weight's width is refused."""
    from backplane.kernels import load

    elementwise = load()
    if _small(device):
        cases = [((40, 1000), None), ((33, 512), (8, 64, 4))]
    else:
        cases = [((2048, 8192), None), ((8192, 2048), None), ((33, 3000), (8, 64, 3))]
    seed = 700
    for ((n, k), launch), dtype in itertools.product(cases, (torch.float32, torch.bfloat16)):
        seed += 1
        x = _randn(1, 2 * k, dtype=dtype, device=device, seed=seed, scale=2.0)
        w = _randn(n, k, dtype=dtype, device=device, seed=seed + 1, scale=k**-0.5)
        b = _randn(n, dtype=dtype, device=device, seed=seed + 2)
        for act in ("silu", "relu2", "gelu"):
            name = f"gemv {n}x{k} {dtype} launch={launch} gate_act={act}"
            want = gemv.gemv(elementwise.act_and_mul(x, act), w, b, launch=launch)
            _equal(name, gemv.gemv(x, w, b, launch=launch, gate_act=act), want)
    try:
        gemv.gemv(x[:, :k], w, gate_act="silu")
    except ValueError:
        return
    raise AssertionError("gemv with gate_act accepted a row of the weight's width")


def _check_gemv_glu(gemv: Any, device: torch.device) -> None:
    """``gemv(x, w, ..., glu=a)`` over a gated MLP's ``[gate | up]`` weight equals the plain
    product followed by the gated activation kernel, bit for bit, split or not, with a norm
    prologue too (the residual stream unchanged); every element of the half-width output is
    compared. An odd row count, row blocks that cannot hold whole pairs, or a gated epilogue
    with an activation epilogue are refused."""
    from backplane.kernels import load

    elementwise = load()
    if _small(device):
        cases = [((80, 1000), None), ((66, 512), (8, 64, 4)), ((34, 300), (16, 128, 3))]
    else:
        cases = [((2 * 8192, 2048), (16, 256, 1)), ((2 * 14336, 4096), (16, 512, 1))]
        cases += [((66, 3000), (8, 64, 3)), ((2 * 1024, 2048), None)]
    seed = 800
    eps = 1e-5
    for ((n, k), launch), dtype in itertools.product(cases, (torch.float32, torch.bfloat16)):
        seed += 1
        x = _randn(1, k, dtype=dtype, device=device, seed=seed)
        w = _randn(n, k, dtype=dtype, device=device, seed=seed + 1, scale=k**-0.5)
        b = _randn(n, dtype=dtype, device=device, seed=seed + 2)
        r = _randn(1, k, dtype=dtype, device=device, seed=seed + 3)
        g = _randn(k, dtype=dtype, device=device, seed=seed + 4, scale=0.5)
        for act, bias in itertools.product(("silu", "relu2", "gelu"), (None, b)):
            name = f"gemv {n}x{k} {dtype} launch={launch} glu={act} bias={bias is not None}"
            got = gemv.gemv(x, w, bias, launch=launch, glu=act)
            assert got.shape == (1, n // 2) and got.dtype == dtype, name
            want = elementwise.act_and_mul(gemv.gemv(x, w, bias, launch=launch), act)
            _equal(name, got, want)
            got, res = gemv.norm_gemv(x, r, g, eps, False, w, bias, launch=launch, glu=act)
            plain, want_res = gemv.norm_gemv(x, r, g, eps, False, w, bias, launch=launch)
            _equal(name + " norm", got, elementwise.act_and_mul(plain, act))
            _equal(name + " norm residual", res, want_res)
    x = _randn(1, 64, dtype=torch.float32, device=device, seed=1)
    for bad_n, bad_launch, act in ((33, (8, 64, 1), None), (32, (1, 64, 1), None),
                                   (32, (8, 64, 1), "relu")):  # fmt: skip
        w = _randn(bad_n, 64, dtype=torch.float32, device=device, seed=2)
        try:
            gemv.gemv(x, w, launch=bad_launch, act=act, glu="silu")
        except ValueError:
            continue
        raise AssertionError(f"gemv accepted a gated epilogue over {bad_n} rows, {bad_launch}")


def _check_norm_gemv(gemv: Any, device: torch.device) -> None:
    """``norm_gemv`` against the norm kernel followed by ``gemv``: the residual stream bit for
    bit, and every output element within what one unit in the last place of each normalised
    input element (the float32 RMS may be summed in another order) and of the output allows;
    with and without a residual, zero-centred or not, split or not, with an activation."""
    from backplane.kernels import load

    elementwise = load()
    if _small(device):
        cases = [((40, 1000), None), ((33, 512), (8, 64, 4))]
    else:
        cases = [((10304, 2048), None), ((3072, 2048), None), ((2048, 8192), None)]
        cases.append(((33, 3000), (8, 64, 3)))
    seed = 900
    eps = 1e-5
    for ((n, k), launch), dtype, with_res, zc in itertools.product(
        cases, (torch.float32, torch.bfloat16), (False, True), (False, True)
    ):
        seed += 1
        x = _randn(1, k, dtype=dtype, device=device, seed=seed)
        r = _randn(1, k, dtype=dtype, device=device, seed=seed + 1) if with_res else None
        g = _randn(k, dtype=dtype, device=device, seed=seed + 2, scale=0.5)
        w = _randn(n, k, dtype=dtype, device=device, seed=seed + 3, scale=k**-0.5)
        b = _randn(n, dtype=dtype, device=device, seed=seed + 4)
        act = "relu2" if zc else None
        name = f"norm_gemv {n}x{k} {dtype} launch={launch} residual={with_res} zc={zc}"
        if r is None:
            h, res = elementwise.rms_norm(x, g, eps, zc), x
        else:
            h, res = elementwise.add_rms_norm(x, r, g, eps, zc)
        want = gemv.gemv(h, w, b, launch=launch, act=act)
        got, got_res = gemv.norm_gemv(x, r, g, eps, zc, w, b, launch=launch, act=act)
        assert got.shape == want.shape and got.dtype == dtype, name
        if r is None:
            assert got_res is x, f"{name}: without a residual the stream is x itself"
        else:
            _equal(name + " residual", got_res, res)
        unit = _unit(dtype) * (2 if device.type == "cpu" and dtype != torch.float32 else 1)
        slack = unit * (h.double().abs() @ w.double().abs().T)
        if act is not None:
            # ReLU² doubles relative errors of its input.
            slack = 2 * slack * want.double().abs().sqrt() + slack**2
        _within(name, got, want.double(), slack + 2 * unit * want.double().abs())
    _check_norm_gemv_rotary(gemv, elementwise, device)
    x = _randn(1, 16, dtype=torch.float32, device=device, seed=1)
    w = _randn(4, 16, dtype=torch.float32, device=device, seed=2)
    for bad_g, bad_r in (
        (torch.ones(15, device=device), None),
        (torch.ones(16, device=device), x.T),
    ):
        try:
            gemv.norm_gemv(x, bad_r, bad_g, eps, False, w)
        except ValueError:
            continue
        raise AssertionError("norm_gemv accepted a norm weight or residual that does not match x")


def _check_norm_gemv_rotary(gemv: Any, elementwise: Any, device: torch.device) -> None:
    """``norm_gemv(rotary=...)`` equals ``norm_gemv`` followed by the rotary kernel on the query
    and key heads, bit for bit in 16-bit types (in float32 the compiler may fuse the rotation's
    products into FMAs: within the rotation's rounding bound of the float64 rotation), split or
    not, with and without a residual; the values are left unrotated; a rotation the launch's
    row blocks cannot hold is refused."""
    if _small(device):
        cases = [((4, 2, 16), 64, (8, 64, 1)), ((3, 1, 32), 96, (16, 32, 2))]
    else:
        cases = [((32, 8, 64), 2048, None), ((32, 8, 64), 2048, (16, 256, 4))]
        cases.append(((16, 2, 128), 1024, None))
    seed = 1200
    eps = 1e-6
    for ((hq, hk, d), k, launch), dtype, with_res in itertools.product(
        cases, (torch.float32, torch.bfloat16), (False, True)
    ):
        seed += 1
        n, rows = (hq + 2 * hk) * d, (hq + hk) * d
        x = _randn(1, k, dtype=dtype, device=device, seed=seed)
        r = _randn(1, k, dtype=dtype, device=device, seed=seed + 1) if with_res else None
        g = _randn(k, dtype=dtype, device=device, seed=seed + 2, scale=0.5)
        w = _randn(n, k, dtype=dtype, device=device, seed=seed + 3, scale=k**-0.5)
        cos, sin = _cos_sin(1, d // 2, dtype, device, seed=seed + 4)
        name = f"norm_gemv rotary heads={hq}+{hk}x{d} {dtype} launch={launch} residual={with_res}"
        plain, want_res = gemv.norm_gemv(x, r, g, eps, False, w, launch=launch)
        want = plain.clone()
        elementwise.rotary_(want[:, :rows].view(1, hq + hk, d), cos, sin)
        got, got_res = gemv.norm_gemv(
            x, r, g, eps, False, w, launch=launch, rotary=(cos, sin, rows)
        )
        if dtype == torch.float32:
            pairs = [(i, i + d // 2) for i in range(d // 2)]
            ref, bound = _rotate_ref(plain[:, :rows].view(1, hq + hk, d), cos, sin, pairs)
            _within(name, got[:, :rows].view(1, hq + hk, d), ref, bound)
            _equal(name + " values", got[:, rows:], plain[:, rows:])
        else:
            _equal(name, got, want)
        if r is not None:
            _equal(name + " residual", got_res, want_res)
    x = _randn(1, 64, dtype=torch.float32, device=device, seed=1)
    w = _randn(40, 64, dtype=torch.float32, device=device, seed=2)
    cos, sin = _cos_sin(1, 4, torch.float32, device, seed=3)
    try:
        # 24 rotated rows end inside the second block of 16
        gemv.norm_gemv(x, None, torch.ones(64, device=device), eps, False, w,
                       launch=(16, 64, 1), rotary=(cos, sin, 24))  # fmt: skip
    except ValueError:
        return
    raise AssertionError("norm_gemv accepted a rotation that straddles a row block")


def _forward_logits(lm, backends, device) -> torch.Tensor:
    """Logits of a ragged prefill of three sequences, one decode step of each, then one decode
    step of the third alone (one row: on CUDA the one-row projection kernels and the norms
    fused into them run)."""
    from backplane.core.forward_context import forward_context, plan_step
    from backplane.core.packing import build_batch_metadata

    page_size = 4
    lm.allocate_caches(
        num_pages=16,
        page_size=page_size,
        num_slots=5,
        dtype=next(lm.parameters()).dtype,
        device=device,
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 3, 5)]
    tables = [[1, 2], [3], [4, 5]]
    logits = []
    steps = [
        (prompts, [0, 0, 0], tables, [1, 2, 3]),
        ([[11], [12], [13]], [7, 3, 5], tables, [1, 2, 3]),
        ([[14]], [6], tables[2:], [3]),
    ]
    for tokens, cached, step_tables, slots in steps:
        batch = build_batch_metadata(
            [len(p) for p in tokens],
            cached,
            step_tables,
            page_size,
            state_slots=slots,
            device=device,
        )
        ids = torch.tensor([x for p in tokens for x in p], dtype=torch.int64, device=device)
        with torch.no_grad(), forward_context(batch, plan_step(backends, batch)):
            hidden = lm(ids, batch.positions)
            logits.append(lm.compute_logits(hidden[: batch.num_tokens]))
    return torch.cat(logits)


def check_model(preset: str, device: torch.device) -> None:
    """The preset's logits with the Triton kernels equal its logits with torch (float32)."""
    from backplane.models import presets

    k = _kernels()
    backends = _torch_backends(_PRESET_FAMILIES[preset])
    if preset == "tiny-qwen3":
        # tiny-llama's shape with Qwen3's per-head query and key norms
        config = {
            **presets.PRESETS["tiny-llama"],
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
        }
        presets.PRESETS[preset] = config
        try:
            lm = presets.build_preset(preset, device=device, backends=backends).model
        finally:
            del presets.PRESETS[preset]
    else:
        lm = presets.build_preset(preset, device=device, backends=backends).model
    assert lm.set_fused_ops("torch") == "torch"
    want = _forward_logits(lm, backends, device)
    calls: dict[str, int] = {}
    originals = {name: getattr(k, name) for name in _KERNEL_FUNCS}

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    try:
        for name, fn in originals.items():
            setattr(k, name, counting(name, fn))
        assert lm.set_fused_ops("triton") == "triton"
        got = _forward_logits(lm, backends, device)
    finally:
        for name, fn in originals.items():
            setattr(k, name, fn)
    missing = _EXPECTED_CALLS[preset] - set(calls)
    assert not missing, f"{preset}: kernels not run: {sorted(missing)} (ran {calls})"
    _close(f"{preset} logits", got, want, {"rtol": 1e-4, "atol": 1e-4})
    assert torch.equal(got.argmax(-1), want.argmax(-1)), f"{preset}: greedy tokens differ"


def run_check(check: str, device: torch.device) -> None:
    """Run one check on ``device``; raise ``AssertionError`` on a mismatch.

    :param check: a name of :data:`CHECKS`.
    :param device: ``cpu`` (in the interpreter) or ``cuda``.
    """
    if check.startswith("model:"):
        check_model(check.split(":", 1)[1], device)
        return
    globals()[f"check_{check}"](device)


# -- the child side -------------------------------------------------------------------------


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CHECKS, lambda check: run_check(check, torch.device("cpu"))))


def test_fake_implementations_run_under_fake_tensors():
    """The fake kernels torch.compile traces with build their outputs like the real ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import backplane.kernels.elementwise  # noqa: F401  (registers the ops)

    ops = torch.ops.backplane_models
    with FakeTensorMode():
        x = torch.empty(5, 3, 16)
        cs = torch.empty(5, 1, 4)
        out = ops.rotary_interleaved(x[:, :, :].transpose(0, 1).transpose(0, 1), cs, cs)
        assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
        assert ops.rotary_(x, cs, cs) is None


def test_one_row_plan_takes_every_weight_and_rotary_needs_whole_pairs():
    """Every weight runs the kernel at one row, 1B-class gate/up and LM heads too, in steps of
    512; the rotary epilogue needs row blocks that hold whole pairs inside the rotated rows."""
    pytest.importorskip("triton", reason="triton is not installed")
    from backplane.kernels import gemv

    sms = 132
    assert gemv.plan(16384, 2048, sms) == (16, 512, 1)
    assert gemv.plan(32000, 2048, sms) == (16, 512, 1)
    assert gemv.plan(10304, 2048, sms) == (16, 256, 1)  # medium: Mamba2 in projection
    assert gemv.plan(3072, 2048, sms) == (8, 512, 1)
    assert gemv.plan(2048, 4096, sms) == (16, 256, 4)  # 1024 columns per split
    bf16 = torch.bfloat16
    assert gemv.rotary_fits((8, 512, 1), 3072, 2560, 32, bf16)
    assert not gemv.rotary_fits((16, 256, 1), 3072, 2552, 4, bf16)  # ends inside a block
    assert not gemv.rotary_fits((8, 512, 1), 3072, 2560, 32, torch.float16)
    assert not gemv.rotary_fits((8, 512, 1), 3072, 2560, 48, bf16)  # not whole heads


def test_long_rows_take_the_kernel_in_wide_chunks():
    """At 8B-class widths (4096 input features) every projection runs the kernel in chunks of
    512, the LM head too; the 1B-class launches stay as measured; FP8 weights with one scale
    per row take their own tiles there, block-scaled ones too where a chunk holds whole blocks."""
    pytest.importorskip("triton", reason="triton is not installed")
    from backplane.kernels import gemv

    sms = 132
    assert gemv.plan(6144, 4096, sms) == (16, 512, 1)  # q/k/v
    assert gemv.plan(28672, 4096, sms) == (16, 512, 1)  # gate/up: cuBLAS before
    assert gemv.plan(128256, 4096, sms) == (16, 512, 1)  # LM head
    assert gemv.plan(4096, 14336, sms) == (16, 512, 2)  # down: 7168 columns per split
    assert gemv.plan(2048, 8192, sms) == (16, 512, 4)  # 1B down: 2048 per split
    assert gemv.plan(2048, 2048, sms) == (8, 512, 1)
    assert gemv.plan_fp8(28672, 4096, sms) == (16, 512, 1, 8)
    assert gemv.plan_fp8(6144, 4096, sms) == (16, 512, 1, 8)  # q/k/v: wide
    assert gemv.plan_fp8(4096, 4096, sms) == (8, 1024, 1)
    assert gemv.plan_fp8(4096, 14336, sms) == (8, 1024, 1)
    assert gemv.plan_fp8(1024, 16384, sms) == (8, 1024, 4)  # 128 row blocks: split to 512
    assert gemv.plan_fp8(6144, 4096, sms, 128) == gemv.plan_fp8(6144, 4096, sms)  # whole blocks
    assert gemv.plan_fp8(6144, 4096, sms, 96) == (16, 32, 1)  # 96 columns: narrowed
    assert gemv.plan_fp8(2048, 2048, sms) == gemv.plan(2048, 2048, sms)
    # A gated prologue on long tall rows: more splits (16-bit), plan()'s tiles (FP8).
    assert gemv.plan_gated(4096, 14336, sms) == (16, 512, 4)
    assert gemv.plan_gated(4096, 14336, sms, fp8=True) == (16, 512, 2)
    # The gated product moves into gate/up's epilogue on 1B-class rows only.
    assert gemv.glu_pays(2048) and not gemv.glu_pays(4096)
    assert gemv.plan_gated(2048, 8192, sms) is None  # 1B down: 2048 columns per split
    assert gemv.plan_gated(28672, 4096, sms) is None  # not tall
    # a rank's half of the 8B down projection: one split in row blocks of 8
    assert gemv.plan_gated(4096, 7168, sms) == (8, 512, 1)
    assert gemv.plan_gated(4096, 7168, sms, fp8=True) is None
    # A launch may name its warps; the projection keeps the three-part shape.
    w = torch.zeros(64, 128, dtype=torch.float32)
    proj = gemv.OneRowProjection(w, launch=(16, 64, 2, 8), pdl=False)
    assert proj.launch == (16, 64, 2) and proj.split_k == 2
