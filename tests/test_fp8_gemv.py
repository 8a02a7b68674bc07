"""The one-row projection kernel with FP8 (e4m3) weights, against float64 over the dequantised weight.

Every scale layout the kernel reads (one scale per tensor, per output row,
per row and block of columns, per square block as a checkpoint stores it)
is checked at shapes whose rows and columns are no multiple of the launch's
blocks nor of the scale blocks, unsplit and split over the reduction, with
the split-K partial sums poisoned with NaN before each call: every output
element lies within its rounding bound of ``x @ (q * s).T`` computed in
float64, and a repeated call gives the same bits. The prologues and the
epilogue ride along unchanged (bit for bit the separate kernels followed by
the plain FP8 product), the scales that do not fit are refused, and an FP8
:class:`~backplane.models.linear.Linear` runs one-row inputs through the
kernel (``fused_ops="triton"``) and more rows elsewhere.

The test weights are rounded to e4m3 by torch, never inside a kernel.
Without CUDA the checks run in the Triton interpreter, in one child process
(see ``tests/interpreter_checks.py``); run one by hand with::

    TRITON_INTERPRET=1 python tests/test_fp8_gemv.py layouts

``tests/test_fp8_gemv_gpu.py`` runs the same checks on a GPU at larger shapes.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import torch
from interpreter_checks import interpreter_tests, main

CHECKS = ("layouts", "wide_chunks", "riders", "refusals", "linear")

#: scale layouts: (name, weight granularity for :func:`quantize_weight`)
LAYOUTS = (
    ("tensor", "tensor"),
    ("row", "channel"),
    ("row-vector", "channel"),
    ("row-blocks", "block"),
    ("square-blocks", "block"),
)

# -- the pytest side ----------------------------------------------------------------

if __name__ != "__main__":
    interpret_results, test_in_interpreter = interpreter_tests(__file__, CHECKS, timeout=900)


# -- the checks ------------------------------------------------------------------------


def _small(device: torch.device) -> bool:
    """The interpreter runs every program in Python: keep its shapes small."""
    return device.type == "cpu"


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int, scale: float = 1.0):
    """Seeded normal values drawn on the CPU, so every device sees the same ones."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device, dtype)


def _unit(dtype: torch.dtype) -> float:
    """The unit roundoff of ``dtype`` (half its machine epsilon)."""
    return torch.finfo(dtype).eps / 2


def quantized(
    n: int, k: int, granularity: str, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An e4m3 weight rounded by torch, its checkpoint-form scales and its row-form scales.

    The rows are given different magnitudes so that a scale read for the
    wrong row or block shows.

    :return: ``(q [n, k], checkpoint scale, row-form scale)``.
    """
    from backplane.models.quant.fp8 import quantize_weight, row_scales

    w = _randn(n, k, dtype=torch.float32, device=torch.device("cpu"), seed=seed, scale=k**-0.5)
    w *= torch.linspace(0.25, 4.0, n)[:, None] * torch.linspace(2.0, 0.5, k)[None, :]
    q, scale = quantize_weight(w, granularity)
    rows = row_scales(scale, n, k, granularity, (128, 128))
    return q.to(device), scale.to(device), rows.to(device)


def kernel_scales(
    layout: str, scale: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, int | None, int]:
    """The ``(scale, scale_k, scale_n)`` arguments of :func:`gemv` for a layout."""
    if layout == "tensor":
        return scale.reshape(()), None, 1
    if layout == "row":
        return rows, None, 1
    if layout == "row-vector":
        return rows.reshape(-1), None, 1
    if layout == "row-blocks":
        return rows, 128, 1
    return scale, 128, 128


def dequantized64(q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``q * s`` in float64 from row-form scales (of 128-column blocks where wider than one)."""
    s = rows.double()
    if s.shape[1] > 1:
        s = s.repeat_interleave(128, dim=1)[:, : q.shape[1]]
    return q.double() * s


def bound(x: torch.Tensor, w64: torch.Tensor, b: torch.Tensor | None, ref: torch.Tensor):
    """The rounding bound of a float32-accumulated row product rounded once to ``x.dtype``.

    Each term's float32 product of the weight, its scale and the input is
    rounded up to twice, the sum once per term; the interpreter's casts to
    16-bit types truncate instead of rounding (twice the unit there).
    """
    k = x.shape[-1]
    absdot = x.double().abs() @ w64.abs().T + (0 if b is None else b.double().abs())
    last = _unit(x.dtype) * (2 if x.device.type == "cpu" and x.dtype != torch.float32 else 1)
    return last * ref.abs() + (2 * k + 4) * _unit(torch.float32) * absdot


def within(name: str, got: torch.Tensor, want64: torch.Tensor, limit: torch.Tensor) -> None:
    """``|got - want64| <= limit`` on every element, NaN failing."""
    assert got.shape == want64.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want64.shape)}"
    err = (got.double() - want64).abs().cpu()
    limit = limit.double().cpu() + 1e-30
    bad = ~(err <= limit)
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} of {got.numel()} elements beyond the rounding bound; "
        f"worst error {float((err / limit).nan_to_num(float('inf')).max()):.3g} x its bound"
    )


def equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """The same dtype, shape and bits."""
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = int((got != want).sum())
    assert diff == 0, f"{name}: {diff} of {got.numel()} elements differ"


def poison_scratch(gemv: Any, device: torch.device) -> None:
    """Fill the split-K partial sums with NaN: a partial read before it is written shows."""
    from backplane.kernels.split_k import SCRATCH

    bufs = SCRATCH.get(device)
    if bufs is not None:
        bufs[1].fill_(float("nan"))


def _device_key(device: torch.device) -> torch.device:
    """The device as the kernel's scratch table keys it (with its index on CUDA)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_layouts(device: torch.device) -> None:
    """Every scale layout, unsplit and split, odd shapes, poisoned partials, within the bound
    of float64 over the dequantised weight; repeated calls give the same bits."""
    from backplane.kernels import load_gemv

    gemv = load_gemv()
    if _small(device):
        shapes = [(40, 300), (130, 520), (17, 1000)]
        launches = [None, (16, 128, 1), (8, 64, 4), (16, 128, 3)]
        dtypes = (torch.bfloat16, torch.float32)
    else:
        shapes = [(2048, 8192), (3072, 2048), (10304, 2048), (130, 3000), (5, 200)]
        launches = [None, (16, 128, 1), (8, 64, 4), (16, 128, 8), (32, 128, 3)]
        dtypes = (torch.bfloat16, torch.float16, torch.float32)
    key = _device_key(device)
    seed = 0
    for (n, k), (layout, gran) in itertools.product(shapes, LAYOUTS):
        seed += 1
        q, scale, rows = quantized(n, k, gran, device, seed)
        w64 = dequantized64(q, rows)
        s, scale_k, scale_n = kernel_scales(layout, scale, rows)
        for dtype, launch in itertools.product(dtypes, launches):
            x = _randn(1, k + 3, dtype=dtype, device=device, seed=seed + 100)[:, 3:]
            b = _randn(n, dtype=dtype, device=device, seed=seed + 200)
            for bias in (None, b) if launch is None else (None,):
                name = f"fp8 gemv {n}x{k} {layout} {dtype} launch={launch} bias={bias is not None}"
                poison_scratch(gemv, key)
                got = gemv.gemv(
                    x, q, bias, launch=launch, scale=s, scale_k=scale_k, scale_n=scale_n
                )
                assert got.shape == (1, n) and got.dtype == dtype, name
                ref = x.double() @ w64.T + (0 if bias is None else bias.double())
                within(name, got, ref, bound(x, w64, bias, ref))
                poison_scratch(gemv, key)
                again = gemv.gemv(
                    x, q, bias, launch=launch, scale=s, scale_k=scale_k, scale_n=scale_n
                )
                equal(name + " (again)", again, got)


def block_quantized(
    n: int, k: int, scale_n: int, scale_k: int, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An e4m3 weight rounded by torch, with block scales drawn apart from it.

    Each ``[scale_n, scale_k]`` block has its own scale, spread over 1/8 to 8
    at random, so a product taking a neighbouring row or column group's scale
    lies far beyond the rounding bound.

    :return: ``(q [n, k], scale [ceil(n / scale_n), ceil(k / scale_k)], q * s in float64)``.
    """
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * k**-0.5
    q = w.clamp(-448, 448).to(torch.float8_e4m3fn)
    shape = (-(-n // scale_n), -(-k // scale_k))
    scale = torch.exp2(torch.rand(shape, generator=g, dtype=torch.float64) * 6 - 3).float()
    s64 = scale.double().repeat_interleave(scale_n, 0)[:n].repeat_interleave(scale_k, 1)[:, :k]
    return q.to(device), scale.to(device), (q.double() * s64).to(device)


def check_wide_chunks(device: torch.device) -> None:
    """Block scales read in chunks holding several column blocks, scaled per column group:
    square blocks (the rows of a program in one row block: the input chunk is scaled),
    row-form blocks and row blocks the programs straddle (the weight tile is scaled), odd
    row and column tails, unsplit and split, poisoned partials; within the bound of float64
    over the dequantised weight, repeated calls giving the same bits. Long rows take the
    row-scaled shapes by default."""
    from backplane.kernels import load_gemv

    gemv = load_gemv()
    if _small(device):
        # (n, k, scale_n, scale_k, launches)
        cases = [
            (100, 300, 32, 32, [(16, 64, 1), (8, 128, 2), (32, 256, 1)]),
            (100, 300, 1, 32, [(16, 64, 1), (8, 128, 3)]),
            (70, 1000, 128, 128, [(16, 256, 1), (8, 512, 2), (16, 1024, 1)]),
            (70, 1000, 1, 128, [(16, 256, 2), (8, 512, 1)]),
            (100, 300, 48, 16, [(32, 64, 1), (16, 128, 2)]),
            (20, 4200, 128, 128, [None]),
            (20, 4200, 1, 128, [None]),
        ]
        dtypes = (torch.bfloat16, torch.float32)
    else:
        deep = [None, (8, 1024, 1), (8, 1024, 4), (16, 512, 1, 8), (32, 256, 2), (64, 512, 3)]
        cases = [
            (2048, 7168, 128, 128, deep),
            (7168, 2048, 128, 128, deep),
            (2048, 7168, 1, 128, deep),
            (7168, 2048, 1, 128, deep),
            (1000, 7000, 128, 128, deep),
            (130, 3000, 48, 16, [(32, 64, 1), (16, 256, 2), (8, 1024, 1)]),
        ]
        dtypes = (torch.bfloat16, torch.float16, torch.float32)
    key = _device_key(device)
    for seed, (n, k, scale_n, scale_k, launches) in enumerate(cases):
        q, s, w64 = block_quantized(n, k, scale_n, scale_k, device, seed)
        sc = dict(scale=s, scale_k=scale_k, scale_n=scale_n)
        for dtype, launch in itertools.product(dtypes, launches):
            x = _randn(1, k, dtype=dtype, device=device, seed=seed + 100)
            b = _randn(n, dtype=dtype, device=device, seed=seed + 200)
            name = f"fp8 gemv {n}x{k} blocks {scale_n}x{scale_k} {dtype} launch={launch}"
            proj = gemv.OneRowProjection(q, b, launch=launch, dtype=dtype, **sc)
            if launch is None and k >= gemv.LONG_ROW:
                # The default launch of a long row holds several blocks per chunk.
                assert proj.launch[1] > scale_k, f"{name}: planned {proj.launch}"
            poison_scratch(gemv, key)
            got, _ = proj(x)
            ref = x.double() @ w64.T + b.double()
            within(name, got, ref, bound(x, w64, b, ref))
            poison_scratch(gemv, key)
            equal(name + " (again)", proj(x)[0], got)


def check_riders(device: torch.device) -> None:
    """The RMS-norm and gated-activation prologues and the activation and gated epilogues over
    an FP8 weight equal, bit for bit, the separate kernels with the plain FP8 product."""
    from backplane.kernels import load, load_gemv

    gemv, ew = load_gemv(), load()
    n, k = (40, 300) if _small(device) else (2048, 2048)
    dtype = torch.bfloat16
    launches = [(16, 128, 1), (8, 64, 3), (16, 256, 2)]
    for (layout, gran), launch in itertools.product(LAYOUTS[::2], launches):
        q, scale, rows = quantized(n, k, gran, device, seed=7)
        s, scale_k, scale_n = kernel_scales(layout, scale, rows)
        sc = dict(scale=s, scale_k=scale_k, scale_n=scale_n)
        x = _randn(1, k, dtype=dtype, device=device, seed=1)
        r = _randn(1, k, dtype=dtype, device=device, seed=2)
        g = _randn(k, dtype=dtype, device=device, seed=3)
        name = f"{layout} launch={launch}"
        proj = gemv.OneRowProjection(q, launch=launch, norm=(g, 1e-6, False), dtype=dtype, **sc)
        y, res = proj(x, r)
        normed, res_want = ew.add_rms_norm(x, r, g, 1e-6, False)
        equal(f"norm prologue {name} (residual)", res, res_want)
        equal(f"norm prologue {name}", y, gemv.gemv(normed, q, launch=launch, **sc))
        gate_up = _randn(1, 2 * k, dtype=dtype, device=device, seed=4)
        got = gemv.gemv(gate_up, q, launch=launch, gate_act="silu", **sc)
        want = gemv.gemv(ew.act_and_mul(gate_up, "silu"), q, launch=launch, **sc)
        equal(f"gated prologue {name}", got, want)
        got = gemv.gemv(x, q, launch=launch, act="relu2", **sc)
        plain = gemv.gemv(x, q, launch=launch, **sc)
        equal(f"relu2 epilogue {name}", got, torch.square(torch.relu(plain)))
        # Gate and up rows in pair order: each row keeps its own (block) scale.
        got = gemv.gemv(x, q, launch=launch, glu="silu", **sc)
        equal(f"gated epilogue {name}", got, ew.act_and_mul(plain, "silu"))


def check_refusals(device: torch.device) -> None:
    """Scales that do not fit the weight, a weight without its scales and chunks straddling
    scale blocks are refused with a ValueError that names the problem."""
    from backplane.kernels import load_gemv

    gemv = load_gemv()
    q, scale, rows = quantized(40, 300, "block", device, seed=5)
    x = _randn(1, 300, dtype=torch.bfloat16, device=device, seed=6)
    bad: list[tuple[str, dict[str, Any], str]] = [
        ("no scales", {}, "needs its scales"),
        (
            "scales of a 16-bit weight",
            {"weight": q.to(torch.bfloat16), "scale": rows, "scale_k": 128},
            "scales go with",
        ),
        ("float64 scales", {"scale": rows.double(), "scale_k": 128}, "float32"),
        ("block scales without scale_k", {"scale": rows}, "fits no layout"),
        ("scale_k not matching", {"scale": rows, "scale_k": 64}, "fits no layout"),
        ("square blocks as rows", {"scale": scale, "scale_k": 128}, "fits no layout"),
        (
            "chunks straddling blocks of 96 columns",
            {"scale": rows[:, :1].repeat(1, 4), "scale_k": 96, "launch": (16, 128, 1)},
            "straddle",
        ),
        (
            "chunks holding blocks narrower than 16 columns",
            {"scale": rows[:, :1].repeat(1, 38), "scale_k": 8, "launch": (16, 64, 1)},
            "straddle",
        ),
    ]
    for name, kwargs, words in bad:
        weight = kwargs.pop("weight", q)
        try:
            gemv.gemv(x, weight, **kwargs)
        except ValueError as exc:
            assert words in str(exc), f"{name}: the error says {exc!r}, not {words!r}"
            continue
        raise AssertionError(f"gemv accepted {name}")
    try:
        gemv.OneRowProjection(q, scale=rows, scale_k=128)
    except ValueError as exc:
        assert "not read by the kernel" in str(exc), str(exc)
    else:
        raise AssertionError("an FP8 projection without an activation dtype was accepted")
    assert gemv.plan_fp8(40, 300, 4, 128)[1] == 128
    # Long rows: the row-scaled shapes where chunks hold whole blocks or lie in one.
    for n, k in ((2048, 7168), (7168, 4096), (4096, 14336), (28672, 4096)):
        for scale_k in (128, 16, 2048):
            assert gemv.plan_fp8(n, k, 132, scale_k) == gemv.plan_fp8(n, k, 132), (n, k, scale_k)
    assert gemv.plan_fp8(4096, 4096, 132, 96)[1] == 32
    assert gemv.plan_fp8(40, 300, 4, 96)[1] == 32
    try:
        gemv.plan_fp8(40, 300, 4, 100)
    except ValueError as exc:
        assert "multiple of 16" in str(exc), str(exc)
    else:
        raise AssertionError("plan_fp8 accepted scale blocks of 100 columns")


def check_linear(device: torch.device) -> None:
    """An FP8 ``Linear`` with ``fused_ops="triton"`` projects one row with the kernel (its
    block scales read in block form), more rows and ``fused_ops="torch"`` elsewhere; scales
    rewritten in place are read anew."""
    from backplane.kernels import load_gemv
    from backplane.models.linear import Linear
    from backplane.models.quant.projection import convert_linear, quantize_linear

    gemv = load_gemv()
    n, k = (260, 300) if _small(device) else (2048, 8192)
    dtype = torch.bfloat16
    for gran in ("channel", "block"):
        lin = Linear(k, n, bias=True).to(device, dtype)
        q, _, rows = quantized(n, k, gran, device, seed=9)
        with torch.no_grad():
            if gran == "channel":
                quantize_linear(lin)
            else:
                convert_linear(lin, 128)
            lin.weight.copy_(q)
            lin.weight_scale.copy_(rows)
            lin.bias.copy_(_randn(n, dtype=dtype, device=device, seed=10))
        w64 = dequantized64(lin.weight, lin.weight_scale)
        x = _randn(1, k, dtype=dtype, device=device, seed=11)
        with torch.inference_mode():
            lin.fused_ops = "torch"
            lin(x)
            assert not lin._projections, f"{gran}: fused_ops=torch reached the kernel"
            lin.fused_ops = "triton"
            got = lin(x)
            (proj,) = [p for p in lin._projections.values() if p]
            if gran == "block":
                assert proj.scale.shape == (-(-n // 128), -(-k // 128)), tuple(proj.scale.shape)
            ref = x.double() @ w64.T + lin.bias.double()
            within(f"Linear {gran} one row", got, ref, bound(x, w64, lin.bias, ref))
            scale_k = 128 if gran == "block" else None
            want = gemv.gemv(
                x, lin.weight, lin.bias, scale=lin.weight_scale, scale_k=scale_k, launch=proj.launch
            )
            equal(f"Linear {gran} one row against row-form scales", got, want)
            x2 = _randn(2, k, dtype=dtype, device=device, seed=12)
            two = lin(x2)
            ref2 = x2.double() @ w64.T + lin.bias.double()
            # More rows: _scaled_mm (activations in e4m3) on capable GPUs, else dequantised.
            torch.testing.assert_close(two.double(), ref2, rtol=0.1, atol=0.1 * ref2.abs().max())
        with torch.no_grad():
            lin.weight_scale.mul_(2.0)
        with torch.inference_mode():
            got = lin(x)
        ref = x.double() @ (2 * w64).T + lin.bias.double()
        within(f"Linear {gran} rescaled in place", got, ref, bound(x, 2 * w64, lin.bias, ref))


def run_check(check: str, device: torch.device) -> None:
    """Run one check on ``device``; raise ``AssertionError`` on a mismatch.

    :param check: a name of :data:`CHECKS`.
    :param device: ``cpu`` (in the interpreter) or ``cuda``.
    """
    globals()[f"check_{check}"](device)


# -- the child side -------------------------------------------------------------------------

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CHECKS, lambda name: run_check(name, torch.device("cpu"))))
