"""The FP8 activation quantisation kernel, bit for bit against the torch reference.

:mod:`backplane.kernels.act_quant` quantises ``[M, K]`` rows to e4m3 with one
float32 scale per row (or one given scale). Its e4m3 bytes and scales must
equal those of :func:`~backplane.models.quant.fp8.quantize_per_token_eager`
and :func:`~backplane.models.quant.fp8.to_fp8` exactly, for float32, bfloat16
and float16 rows; rows of zeros (the least scale), of magnitudes down to
e4m3's subnormals and up to its saturation bound; every e4m3 value, the
midpoints between neighbours and one float32 step either side of them;
widths held in registers and widths read in pieces, odd row counts, rows of
a wider tensor; and an output buffer poisoned before the call. NaN and
infinity give NaN where the reference does (NaN's sign bit aside: torch's
CPU and CUDA divisions differ there). Bad arguments are refused with a
message.

Without CUDA the checks run in the Triton interpreter, in one child process
(see ``tests/interpreter_checks.py``); run one by hand with::

    TRITON_INTERPRET=1 python tests/test_fp8_act_quant.py per_token

The compiled kernel's rounding is checked on the CPU too: it compiles for
sm_90 with the correctly rounded division and the round-to-nearest e4m3
conversion. ``tests/test_fp8_act_quant_gpu.py`` runs the checks on a GPU.
"""

from __future__ import annotations

import re
import sys

import torch
from interpreter_checks import interpreter_tests, main

CHECKS = ("per_token", "rounding", "static", "nonfinite", "refusals")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: ``(M, K)``: one column, odd widths in registers (4099 rounds up to 8192
#: columns), widths read in pieces (above 8192), several rows per program
SHAPES = ((1, 1), (3, 17), (7, 64), (2, 4099), (3, 9000))

# -- the pytest side ----------------------------------------------------------------

if __name__ != "__main__":
    import pytest

    interpret_results, test_in_interpreter = interpreter_tests(__file__, CHECKS, timeout=600)

    @pytest.mark.parametrize("single", [True, False])
    def test_compiles_for_sm90(single: bool) -> None:
        """The kernel compiles for Hopper with a correctly rounded float32 division and the
        round-to-nearest saturating e4m3 conversion (no reciprocal, no float16 detour)."""
        triton = pytest.importorskip("triton", reason="triton is not installed")
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from backplane.kernels import act_quant

        signature = {
            "x_ptr": "*bf16",
            "q_ptr": "*fp8e4nv",
            "s_ptr": "*fp32",
            "m": "i32",
            "k": "i32",
            "stride_x": "i32",
            "stride_q": "i32",
        }
        consts = {
            "BLOCK_M": 1,
            "BLOCK_K": 4096,
            "SINGLE": single,
            "STATIC": False,
            "INTERPRET": False,
        }
        signature.update(dict.fromkeys(consts, "constexpr"))
        src = ASTSource(fn=act_quant._act_quant_kernel, signature=signature, constexprs=consts)
        compiled = triton.compile(
            src,
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 8, "enable_fp_fusion": False},
        )
        ptx = compiled.asm["ptx"]
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
        assert "div.rn.f32" in ptx
        assert not re.search(r"\b(rcp|div\.(approx|full))\.", ptx)
        assert not re.search(r"cvt\.[a-z.]*f16\.f32", ptx)
        assert compiled.asm["cubin"]


# -- the checks ------------------------------------------------------------------------


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Seeded rows whose magnitudes span 1e-9 (e4m3 subnormals after scaling against the
    row's largest value) to 1e4 (above e4m3's range unscaled), the first row zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    x *= torch.logspace(-2, 4, m, dtype=torch.float64)[:, None]
    # a few tiny values per row: they quantise to e4m3 subnormals or to zero
    x[:, ::7] *= 1e-5
    x[0] = 0.0
    return x.to(dtype)


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal bits (float32 scales through int32, e4m3 through uint8)."""
    as_int = {torch.float32: torch.int32, torch.float8_e4m3fn: torch.uint8}
    g, w = got.view(as_int[got.dtype]), want.view(as_int[want.dtype])
    diff = (g != w).nonzero()
    assert diff.numel() == 0, (
        f"{what}: {diff.shape[0]} of {g.numel()} differ, first at {diff[0].tolist()}: "
        f"{got[tuple(diff[0])].float().item()} != {want[tuple(diff[0])].float().item()}"
    )


def _poisoned(shape: tuple[int, int]) -> torch.Tensor:
    """An e4m3 buffer of NaN bytes: an element the kernel skips stays NaN."""
    return torch.full(shape, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)


def check_per_token() -> None:
    """Every dtype and shape, into a fresh and a poisoned buffer, and rows of a wider tensor."""
    from backplane.kernels import act_quant
    from backplane.models.quant.fp8 import quantize_per_token_eager

    for seed, (dtype, (m, k)) in enumerate((d, s) for d in DTYPES for s in SHAPES):
        x = _rows(m, k, dtype, seed)
        want_q, want_s = quantize_per_token_eager(x)
        q, s = act_quant.quantize_per_token(x)
        _assert_same(s, want_s, f"scale {dtype} {m}x{k}")
        _assert_same(q, want_q, f"q {dtype} {m}x{k}")
        assert s.shape == (m, 1) and q.shape == (m, k)
        out = _poisoned((m, k))
        q2, s2 = act_quant.quantize_per_token(x, out=out)
        assert q2.data_ptr() == out.data_ptr()
        _assert_same(q2, want_q, f"poisoned q {dtype} {m}x{k}")
        _assert_same(s2, want_s, f"poisoned scale {dtype} {m}x{k}")
    # the zero row's scale is the least one, and its values zeros
    assert torch.all(want_s[0] == torch.tensor(1e-12, dtype=torch.float32))
    wide = _rows(5, 300, torch.bfloat16, 99)
    x = wide[:, 20:277]
    want_q, want_s = quantize_per_token_eager(x)
    q, s = act_quant.quantize_per_token(x)
    _assert_same(q, want_q, "rows of a wider tensor")
    _assert_same(s, want_s, "scales of rows of a wider tensor")


def _rounding_values() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints of neighbours and one float32 step either side
    of them, the bound and beyond, both signs and negative zero."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3)].unique()
    mids = (e4m3[1:] + e4m3[:-1]) / 2

    def step(t: torch.Tensor, to: float) -> torch.Tensor:
        return torch.nextafter(t, torch.full_like(t, to))

    extra = torch.tensor([448.0, 449.0, 464.0, 465.0, 1e6, 2.0**-10, 3 * 2.0**-11, 1e-30])
    pos = torch.cat([e4m3, mids, step(mids, 1e9), step(mids, -1e9), extra])
    return torch.cat([pos, -pos, torch.tensor([-0.0])])


def check_rounding() -> None:
    """Round to nearest even around every e4m3 value, saturation, subnormals, the sign of
    zero: through the static kernel (scale 1 and 2**-3, exact) and through per-token rows
    whose largest value sets the scale."""
    from backplane.kernels import act_quant
    from backplane.models.quant.fp8 import quantize_per_token_eager, to_fp8

    v = _rounding_values()
    for scale in (1.0, 0.125):
        x = (v * scale)[None, :]
        s = torch.tensor([scale])
        _assert_same(act_quant.quantize_static(x, s), to_fp8(x, s), f"static scale {scale}")
    # x / scale within a float32 step or two of a midpoint for a scale whose reciprocal is
    # inexact: a product by the reciprocal instead of the division lands on the other side
    scale = torch.tensor([0.37])
    near = (v * scale)[None, :]
    for _ in range(2):
        near = torch.cat([near, torch.nextafter(near, near * 2), torch.nextafter(near, near / 2)])
    near = near.flatten()[None, :]
    _assert_same(act_quant.quantize_static(near, scale), to_fp8(near, scale), "near midpoints")
    # rows: the values times a factor, and the row's maximum placed first so that
    # x / scale lands at and beyond the bound after the scale's rounding
    rows = []
    for f in (1.0, 3.1, 0.0071, 1e-3):
        r = v[v.abs() <= 448] * f
        rows.append(torch.cat([torch.tensor([448.0 * f * 1.0000001]), r]))
    x = torch.stack(rows)
    want_q, want_s = quantize_per_token_eager(x)
    q, s = act_quant.quantize_per_token(x)
    _assert_same(s, want_s, "per-token scales")
    _assert_same(q, want_q, "per-token rounding")
    # saturation was reached: some values land on +-448
    assert (want_q.float().abs() == 448).any()


def check_static() -> None:
    """The static variant for each dtype and shape, scales of any shape of one value."""
    from backplane.kernels import act_quant
    from backplane.models.quant.fp8 import to_fp8

    scales = (torch.tensor([0.37]), torch.tensor(2.5e-3), torch.tensor([[1.0]]))
    for seed, (dtype, (m, k)) in enumerate((d, s) for d in DTYPES for s in SHAPES):
        x = _rows(m, k, dtype, 100 + seed)
        scale = scales[seed % len(scales)]
        want = to_fp8(x, scale)
        _assert_same(act_quant.quantize_static(x, scale), want, f"static {dtype} {m}x{k}")
        out = _poisoned((m, k))
        act_quant.quantize_static(x, scale, out=out)
        _assert_same(out, want, f"poisoned static {dtype} {m}x{k}")
    x = _rows(4, 33, torch.bfloat16, 7)
    scale = torch.tensor([0.0123], dtype=torch.bfloat16)
    _assert_same(act_quant.quantize_static(x, scale), to_fp8(x, scale), "bfloat16 scale")


def check_nonfinite() -> None:
    """A row holding NaN gets a NaN scale and NaN values; a row holding infinity an infinite
    scale, NaN at the infinity and zeros elsewhere; other rows as ever."""
    from backplane.kernels import act_quant
    from backplane.models.quant.fp8 import quantize_per_token_eager

    for k in (33, 9000):
        x = _rows(4, k, torch.float32, 11)
        x[1, 5] = float("nan")
        x[2, 3] = float("-inf")
        want_q, want_s = quantize_per_token_eager(x)
        q, s = act_quant.quantize_per_token(x)
        assert torch.equal(s.isnan(), want_s.isnan()), (s, want_s)
        finite = ~want_s.isnan()
        _assert_same(s[finite], want_s[finite], f"scales k={k}")
        qf, wf = q.float(), want_q.float()
        assert torch.equal(qf.isnan(), wf.isnan()), f"NaN positions differ at k={k}"
        keep = ~wf.isnan()
        _assert_same(q[keep], want_q[keep], f"finite values k={k}")
        assert wf[1].isnan().all() and wf[2].isnan().sum() == 1


def check_refusals() -> None:
    """Shapes, dtypes, outputs and scales the kernel cannot take are refused, saying so."""
    from backplane.kernels import act_quant

    x = torch.ones(3, 8)
    cases = (
        (lambda: act_quant.quantize_per_token(torch.ones(2, 3, 8)), ValueError, "[M, K]"),
        (lambda: act_quant.quantize_per_token(x.to(torch.int32)), TypeError, "convert"),
        (
            lambda: act_quant.quantize_per_token(x, out=torch.empty(3, 8)),
            ValueError,
            "out must be",
        ),
        (
            lambda: act_quant.quantize_per_token(x, out=_poisoned((3, 7))),
            ValueError,
            "out must be",
        ),
        (lambda: act_quant.quantize_static(x, torch.ones(2)), ValueError, "one value"),
    )
    for call, exc, words in cases:
        try:
            call()
        except exc as e:
            assert words in str(e), str(e)
        else:
            raise AssertionError(f"no {exc.__name__} ({words})")
    # no rows: nothing to do, empty results
    q, s = act_quant.quantize_per_token(torch.ones(0, 8, dtype=torch.bfloat16))
    assert q.shape == (0, 8) and s.shape == (0, 1)


def run_check(name: str) -> tuple[str, str] | None:
    """Run one check by name (child side)."""
    globals()[f"check_{name}"]()
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CHECKS, run_check))
