"""The quantised one-row kernel (backplane.kernels.qgemv) against gguf's reference dequantisation.

Each check multiplies one input row by random GGUF blocks of one type, with
the kernel dequantising in registers, and compares the row with the float64
product of the input and ``gguf.quants.dequantize``'s matrix. A check also
runs :class:`~backplane.models.gguf.qlinear.QuantizedLinear` at one row and
makes sure the kernel is what ran.

On a machine without CUDA the checks run in the Triton interpreter (float32),
which must be switched on before ``triton`` is first imported: so they run in
one child process (this file executed as a script with ``TRITON_INTERPRET=1``)
and each pytest test reports one check. By hand::

    TRITON_INTERPRET=1 python tests/test_gguf_quant_kernel.py Q4_K

The tests marked ``gpu`` run the same checks on a CUDA device in bfloat16 too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from interpreter_checks import interpreter_tests, interpreting, main

ROOT = Path(__file__).resolve().parent.parent
CHECKS = [
    "Q8_0",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "Q8_0-narrow",
    "dequant-Q8_0",
    "dequant-Q4_K",
    "dequant-Q5_K",
    "dequant-Q6_K",
    "module",
]


def _check(name: str, device: torch.device, dtype: torch.dtype) -> None:
    """Run one check; raises AssertionError on a wrong value."""
    import gguf

    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_quant_helpers import QT, random_blocks

    from backplane import kernels

    qgemv = kernels.load_qgemv()
    rng = np.random.default_rng(len(name))
    if name == "module":
        _check_module(device, dtype)
        return
    if name.startswith("dequant-"):
        qtype = QT[name.removeprefix("dequant-")]
        blocks = random_blocks(qtype, 21, 768, rng)
        want = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))
        got = qgemv.dequantize_blocks(torch.from_numpy(blocks).to(device), int(qtype), 768, dtype)
        assert got.shape == (21, 768) and got.dtype == dtype, (got.shape, got.dtype)
        # float32: the reference's values (a contracted multiply-add may move the last bit)
        tol = torch.finfo(dtype).eps * want.abs() if dtype != torch.float32 else 2e-7 * want.abs()
        err = (got.float().cpu() - want).abs()
        assert (err <= tol).all(), f"{name}: max error {err.max().item():.3g}"
        return
    qtype = QT[name.split("-")[0]]
    # 37 rows: not a multiple of the rows per program; 96 values: a partial tile of Q8_0
    cols = 96 if name.endswith("narrow") else 512
    blocks = random_blocks(qtype, 37, cols, rng)
    w = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float64))
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = qgemv.quantized_gemv(x.to(device), torch.from_numpy(blocks).to(device), int(qtype), cols)
    assert got.shape == (1, 37) and got.dtype == dtype, (got.shape, got.dtype)
    want = x.double() @ w.T
    # float32 accumulation, then one rounding to the output dtype
    eps = torch.finfo(dtype).eps
    bound = 1e-5 * (x.double().abs() @ w.abs().T) + eps * want.abs() + 1e-6
    err = (got.double().cpu() - want).abs()
    assert (err <= bound).all(), f"{name}: max error {err.max().item():.3g}"


def _check_module(device: torch.device, dtype: torch.dtype) -> None:
    """A QuantizedLinear of mixed types at one row runs a kernel once per run of rows: its
    Q4_K and Q6_K runs repacked (raw blocks dropped), its Q5_K run as raw blocks."""
    import gguf
    from gguf_quant_helpers import QT, random_blocks

    from backplane import kernels
    from backplane.models.gguf.qlinear import QuantizedLinear

    rng = np.random.default_rng(5)
    types = (QT.Q4_K, QT.Q6_K, QT.Q5_K)
    parts = [(name, 48, int(t)) for name, t in zip(("gate", "up", "down"), types, strict=True)]
    blocks = [random_blocks(t, 48, 512, rng) for t in types]
    m = QuantizedLinear(512, parts, dtype=dtype, device=device)
    m.fused_ops = "triton"
    targets = dict(m.checkpoint_slices())
    with torch.no_grad():
        for (part, _, _), b in zip(parts, blocks, strict=True):
            targets[f"{part}.weight"].copy_(torch.from_numpy(b))
    qgemv = kernels.load_qgemv()
    packed = kernels.load_qgemv_packed()
    packed6 = kernels.load_qgemv_packed_q6k()
    w = torch.cat(
        [
            torch.from_numpy(gguf.quants.dequantize(b, t).astype(np.float64))
            for b, t in zip(blocks, types, strict=True)
        ]
    )
    # one row: the one-row kernels per run of rows (Q4_K and Q6_K repacked at the first
    # product); three rows: the dequantising kernels
    kernel_pairs = (
        (1, (packed, "packed_gemv"), (packed6, "packed_gemv"), (qgemv, "quantized_gemv")),
        (
            3,
            (packed, "dequantize_packed_matrix"),
            (packed6, "dequantize_packed_matrix"),
            (qgemv, "dequantize_blocks"),
        ),
    )
    for rows, *pair in kernel_pairs:
        calls = []
        reals = [getattr(mod, name) for mod, name in pair]
        labels = [f"{mod.__name__.rpartition('.')[2]}.{name}" for mod, name in pair]
        for (mod, name), real, label in zip(pair, reals, labels, strict=True):

            def counted(*args, real=real, calls=calls, label=label, **kwargs):
                calls.append(label)
                return real(*args, **kwargs)

            setattr(mod, name, counted)
        try:
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
            with torch.no_grad():
                got = m(x.to(device))
        finally:
            for (mod, name), real in zip(pair, reals, strict=True):
                setattr(mod, name, real)
        assert calls == labels, (rows, calls)
        assert m.packed_runs == {0, 1}, "Q4_K and Q6_K were not repacked"
        assert m.qweight_0.numel() == 0 and m.qweight_1.numel() == 0, "raw blocks were kept"
        assert m.qweight_2.numel() > 0, "Q5_K stays raw"
        want = x.double() @ w.T
        eps = torch.finfo(dtype).eps
        bound = 1e-5 * (x.double().abs() @ w.abs().T) + eps * want.abs() + 1e-6
        if dtype != torch.float32:  # the matrix itself is rounded to the dtype first
            bound = bound + eps * (x.double().abs() @ w.abs().T)
        assert ((got.double().cpu() - want).abs() <= bound).all(), pair


# -- the pytest side ------------------------------------------------------------------------

if __name__ != "__main__":
    import pytest

    pytest.importorskip("gguf")

    interpret_results, test_in_interpreter = interpreter_tests(__file__, CHECKS)

    @pytest.mark.gpu
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("check", CHECKS)
    def test_on_gpu(check, dtype):
        """One check, run on a CUDA device."""
        pytest.importorskip("triton", reason="triton is not installed")
        if not torch.cuda.is_available() or interpreting():
            pytest.skip("needs a CUDA device (and TRITON_INTERPRET unset)")
        _check(check, torch.device("cuda"), dtype)


# -- the child side -------------------------------------------------------------------------


if __name__ == "__main__":
    sys.exit(
        main(sys.argv[1:], CHECKS, lambda check: _check(check, torch.device("cpu"), torch.float32))
    )
