"""The few-row FP8 product kernel against a float64 reference.

:func:`backplane.kernels.fp8_few_rows.scaled_mm` multiplies up to
``MAX_ROWS`` e4m3 rows by an e4m3 weight, scales each output by its row's and
column's float32 scale and adds the bias. Its output must match the float64
product of the same e4m3 values (float32 accumulation: relative 1e-5 of the
row's largest term), for one and several splits along K, with and without a
bias, for every row count up to a tile and past one; its split-K counters
must read zero again after every launch; and bad arguments are refused with
a message.

Without CUDA the checks run in the Triton interpreter, in one child process
(see ``tests/interpreter_checks.py``); run one by hand with::

    TRITON_INTERPRET=1 python tests/test_fp8_few_rows.py products

On a GPU (``-m gpu``) the same checks run at the 8B shape's projections, and
an FP8 projection of a few rows equals the one ``torch._scaled_mm`` gives.
"""

from __future__ import annotations

import sys

import torch
from interpreter_checks import interpreter_tests, kernel_gpu, main

CHECKS = ("products", "launches", "refusals")

if __name__ != "__main__":
    import pytest

    interpret_results, test_in_interpreter = interpreter_tests(__file__, CHECKS, timeout=600)


def _case(m: int, n: int, k: int, device: str, seed: int):
    """Seeded e4m3 rows and weight, positive scales, a bias."""
    g = torch.Generator().manual_seed(seed)
    qx = (torch.randn(m, k, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    sa = torch.rand(m, 1, generator=g) * 0.01 + 1e-3
    sb = torch.rand(n, 1, generator=g) * 0.01 + 1e-3
    bias = torch.randn(n, generator=g)
    return qx.to(device), w.to(device), sa.to(device), sb.to(device), bias.to(device)


def _check(
    m: int, n: int, k: int, device: str, out_dtype: torch.dtype, seed: int, launch=None
) -> None:
    from backplane.kernels import fp8_few_rows as few
    from backplane.kernels.split_k import SCRATCH

    qx, w, sa, sb, bias = _case(m, n, k, device, seed)
    terms = qx.double().abs() @ w.double().abs().T * sa.double() * sb.double().T
    for b in (None, bias):
        got = few.scaled_mm(qx, w, sa, sb, b, out_dtype, launch).double()
        want = qx.double() @ w.double().T * sa.double() * sb.double().T
        if b is not None:
            want += b.double()
        assert got.shape == (m, n)
        # float32 accumulation, then the output's rounding
        eps = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[out_dtype]
        bound = 1e-5 * terms + eps * want.abs() + 1e-6
        bad = ((got - want).abs() > bound).nonzero()
        assert bad.numel() == 0, (
            f"{m}x{n}x{k} {out_dtype} bias={b is not None}: {bad.shape[0]} of {got.numel()} "
            f"off, first at {bad[0].tolist()}: {got[tuple(bad[0])].item()} != "
            f"{want[tuple(bad[0])].item()}"
        )
    counters = SCRATCH.get(qx.device)
    if counters is not None:
        assert int(counters[0].abs().sum()) == 0, "split-K counters left non-zero"


def check_products(device: str = "cpu", big: bool = False) -> None:
    """Row counts around the tile sizes, one and several splits, float32 and float16 out."""
    from backplane.kernels import fp8_few_rows as few

    # (5, 128, 1280): its last split holds fewer steps than the others
    shapes = [(1, 64, 128), (3, 128, 512), (16, 192, 256), (17, 64, 1024), (32, 128, 384)]
    shapes += [(5, 128, 1280)]
    if big:
        # the 8B shape's projections: q/k/v, o, gate/up, down
        shapes += [(19, 6144, 4096), (32, 4096, 4096), (8, 28672, 4096), (31, 4096, 14336)]
    dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if big else ())
    for seed, ((m, n, k), dt) in enumerate((s, d) for s in shapes for d in dtypes):
        _check(m, n, k, device, dt, seed)
    # past WIDE_MAX_ROWS rows only a weight too narrow for cuBLAS's tiles to fill the device
    wide = torch.empty(32 * few._sms(torch.device(device)), 128, dtype=torch.float8_e4m3fn)
    assert few.supports(few.WIDE_MAX_ROWS, wide) and not few.supports(few.WIDE_MAX_ROWS + 1, wide)
    assert few.supports(few.MAX_ROWS, wide[:64])
    # several splits are planned for these shapes on the interpreter's 4 "multiprocessors"
    assert few.split_plan(128, 512, 4)[0] > 1 and few.split_plan(64, 1024, 4)[0] > 1


def check_launches(device: str = "cpu") -> None:
    """Tilings the planner and the benchmark's sweep may pick: several row blocks, wide and
    deep tiles, a last split shorter than the others; against float64 as above."""
    from backplane.kernels import fp8_few_rows as few

    launch = few.Launch
    cases = [
        # three row blocks of 16 (the last one partial), two splits
        (40, 128, 512, launch(16, 64, 128, 2, 256, 4, 2)),
        # three row blocks of 32, 128-column tiles, 256-column steps
        (70, 128, 512, launch(32, 128, 256, 2, 256, 4, 2)),
        # four row blocks of 32, one split
        (128, 64, 256, launch(32, 64, 128, 1, 256, 4, 3)),
        # 256-column steps whose last split is shorter
        (5, 128, 768, launch(16, 128, 256, 2, 512, 4, 2)),
    ]
    old = few.MAX_ROWS, few.WIDE_MAX_ROWS
    few.MAX_ROWS = few.WIDE_MAX_ROWS = 128
    try:
        for seed, (m, n, k, lz) in enumerate(cases):
            _check(m, n, k, device, torch.float32, seed, lz)
    finally:
        few.MAX_ROWS, few.WIDE_MAX_ROWS = old
    # the planner's choice for every row count up to MAX_ROWS stays within the tiles
    for m in range(1, few.MAX_ROWS + 1):
        lz = few.plan(m, 4096, 4096, 132)
        assert lz.block_m in (16, 32) and lz.block_m >= min(m, 32), (m, lz)
        assert 4096 % lz.block_n == 0 and 4096 % lz.block_k == 0, (m, lz)


def check_refusals(device: str = "cpu") -> None:
    """Too many rows, partial tiles and a non-e4m3 weight are refused with a message."""
    from backplane.kernels import fp8_few_rows as few

    qx, w, sa, sb, _ = _case(few.MAX_ROWS + 1, 64, 128, device, 0)
    assert not few.supports(few.MAX_ROWS + 1, w) and few.supports(few.MAX_ROWS, w)
    assert not few.supports(4, w[:48]) and not few.supports(4, w[:, :96])
    assert not few.supports(4, w.to(torch.float16))
    try:
        few.scaled_mm(qx, w, sa, sb, None, torch.float32)
    except ValueError as e:
        assert "rows" in str(e) and "against an e4m3 weight" in str(e), str(e)
    else:
        raise AssertionError("no ValueError for too many rows")


def run_check(name: str) -> tuple[str, str] | None:
    """Run one check by name (child side)."""
    globals()[f"check_{name}"]()
    return None


if __name__ != "__main__":

    @pytest.mark.gpu
    def test_products_on_a_gpu() -> None:
        kernel_gpu((8, 9), "e4m3 products")
        check_products("cuda", big=True)
        check_launches("cuda")
        check_refusals("cuda")

    @pytest.mark.gpu
    @pytest.mark.parametrize("rows", [2, 19, 32])
    def test_fp8_projection_of_a_few_rows_matches_scaled_mm(rows: int) -> None:
        from backplane.kernels import fp8_few_rows as few
        from backplane.models.linear import Linear
        from backplane.models.quant.fp8 import quantize_per_token
        from backplane.models.quant.projection import quantize_linear

        kernel_gpu((8, 9), "e4m3 products")
        torch.manual_seed(rows)
        linear = Linear(4096, 1024, bias=True).to("cuda", torch.bfloat16)
        quantize_linear(linear)
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        assert few.supports(rows, linear.weight)
        got = linear(x)
        qx, scale_a = quantize_per_token(x)
        want = torch._scaled_mm(
            qx,
            linear.weight.t(),
            scale_a=scale_a.contiguous(),
            scale_b=linear.weight_scale.reshape(1, -1),
            bias=linear.bias,
            out_dtype=x.dtype,
        )
        # both sum float32 products of the same e4m3 values: equal to the bfloat16 rounding
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CHECKS, run_check))
