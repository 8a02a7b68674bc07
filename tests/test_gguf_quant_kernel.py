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

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
import torch

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
    """A QuantizedLinear of mixed types at one row runs the kernel once per run of rows."""
    import gguf
    from gguf_quant_helpers import QT, random_blocks

    from backplane import kernels
    from backplane.models.gguf.qlinear import QuantizedLinear

    rng = np.random.default_rng(5)
    parts = [("gate_proj", 48, int(QT.Q4_K)), ("up_proj", 48, int(QT.Q6_K))]
    blocks = [random_blocks(QT.Q4_K, 48, 256, rng), random_blocks(QT.Q6_K, 48, 256, rng)]
    m = QuantizedLinear(256, parts, dtype=dtype, device=device)
    m.fused_ops = "triton"
    targets = dict(m.checkpoint_slices())
    with torch.no_grad():
        for (part, _, _), b in zip(parts, blocks, strict=True):
            targets[f"{part}.weight"].copy_(torch.from_numpy(b))
    qgemv = kernels.load_qgemv()
    w = torch.cat(
        [
            torch.from_numpy(gguf.quants.dequantize(b, t).astype(np.float64))
            for b, t in zip(blocks, (QT.Q4_K, QT.Q6_K), strict=True)
        ]
    )
    # one row: the one-row kernel per run of rows; three rows: the dequantising kernel
    for rows, kernel, type_at in ((1, "quantized_gemv", 2), (3, "dequantize_blocks", 1)):
        calls = []
        real = getattr(qgemv, kernel)

        def counted(*args, real=real, calls=calls, type_at=type_at, **kwargs):
            calls.append(args[type_at])
            return real(*args, **kwargs)

        setattr(qgemv, kernel, counted)
        try:
            x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
            with torch.no_grad():
                got = m(x.to(device))
        finally:
            setattr(qgemv, kernel, real)
        assert calls == [int(QT.Q4_K), int(QT.Q6_K)], (kernel, calls)
        want = x.double() @ w.T
        eps = torch.finfo(dtype).eps
        bound = 1e-5 * (x.double().abs() @ w.abs().T) + eps * want.abs() + 1e-6
        if dtype != torch.float32:  # the matrix itself is rounded to the dtype first
            bound = bound + eps * (x.double().abs() @ w.abs().T)
        assert ((got.double().cpu() - want).abs() <= bound).all(), kernel


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# -- the pytest side ------------------------------------------------------------------------

if __name__ != "__main__":
    import pytest

    pytest.importorskip("gguf")

    @pytest.fixture(scope="module")
    def interpret_results() -> dict[str, dict[str, str]]:
        """Run every check in one child process under ``TRITON_INTERPRET=1``."""
        pytest.importorskip("triton", reason="triton is not installed")
        env = dict(os.environ, TRITON_INTERPRET="1")
        with tempfile.TemporaryDirectory() as tmp:
            result_file = Path(tmp) / "results.json"
            proc = subprocess.run(
                [sys.executable, __file__, "--json", str(result_file), *CHECKS],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=600,
            )
            if not result_file.exists():
                pytest.fail(
                    f"interpreter checks crashed (rc={proc.returncode}):\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
                )
            return json.loads(result_file.read_text())

    @pytest.mark.parametrize("check", CHECKS)
    def test_in_interpreter(interpret_results, check):
        """One check, run on CPU tensors in the Triton interpreter, in float32."""
        res = interpret_results.get(check)
        assert res is not None, f"check {check} did not report"
        assert res["status"] == "ok", res["detail"]

    @pytest.mark.gpu
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("check", CHECKS)
    def test_on_gpu(check, dtype):
        """One check, run on a CUDA device."""
        pytest.importorskip("triton", reason="triton is not installed")
        if not torch.cuda.is_available() or _interpreting():
            pytest.skip("needs a CUDA device (and TRITON_INTERPRET unset)")
        _check(check, torch.device("cuda"), dtype)


# -- the child side -------------------------------------------------------------------------


def _main(argv: list[str]) -> int:
    out_file = None
    if argv[:1] == ["--json"]:
        out_file, argv = Path(argv[1]), argv[2:]
    if not _interpreting():
        print("set TRITON_INTERPRET=1 before running these checks", file=sys.stderr)
        return 2
    results: dict[str, dict[str, str]] = {}
    for check in argv or CHECKS:
        try:
            _check(check, torch.device("cpu"), torch.float32)
            results[check] = {"status": "ok", "detail": ""}
        except Exception:  # noqa: BLE001 - every failure is reported to the pytest side
            results[check] = {"status": "fail", "detail": traceback.format_exc()[-6000:]}
        print(f"{check}: {results[check]['status']}", file=sys.stderr)
    if out_file is not None:
        out_file.write_text(json.dumps(results))
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(_main(sys.argv[1:]))
