"""What the interpreter checks of the packed one-row kernels share (Q4_K and Q6_K).

Random GGUF blocks of one type with gguf's float64 matrix of them (numpy,
independent of backplane), and one product of a repacked weight checked against
that matrix: the output and the split-K partials poisoned with NaN before the
call, every element within float32 sums and one rounding of the float64
product, the arrival counters left at zero and a second run giving the same
bits. Imported by the child processes that run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch


def weight(qtype: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random blocks of ``qtype`` (``"Q4_K"``, ``"Q6_K"``) and gguf's float64 matrix of them.

    :return: ``(blocks [rows, row bytes] uint8, matrix [rows, cols] float64)``.
    """
    import gguf
    from gguf_quant_helpers import QT, random_blocks

    t = QT[qtype]
    blocks = random_blocks(t, rows, cols, np.random.default_rng(seed))
    return blocks, torch.from_numpy(gguf.quants.dequantize(blocks, t).astype(np.float64))


def product(
    qp: ModuleType,
    repack: Callable[[torch.Tensor, int], Any],
    blocks: np.ndarray,
    w: torch.Tensor,
    x: torch.Tensor,
    launch: Any = None,
    what: str = "",
) -> torch.Tensor:
    """One poisoned product of ``x`` and ``blocks`` repacked, against ``x @ w.T`` in float64.

    :param qp: the kernel module (``qgemv_packed`` or ``qgemv_packed_q6k``).
    :param repack: its layout's repacking function.
    :param blocks: the raw blocks; ``w`` their float64 matrix.
    :param x: one input row.
    :param launch: a launch of the module, ``None`` for the planned one.
    :param what: names the case in a failure.
    :return: the output row.
    """
    rows, cols = w.shape
    packed = repack(torch.from_numpy(blocks), cols)
    grid, _, _ = qp._launch(rows, cols, qp._sm_count(x.device), launch)
    split_k = grid[1]
    if split_k > 1:
        # partials the kernel must overwrite before it sums them
        _, part = qp._scratch(x.device, grid[0], split_k * rows)
        part.fill_(float("nan"))
    out = torch.full((1, rows), float("nan"), dtype=x.dtype)
    got = qp.packed_gemv(x, packed, out=out, launch=launch)
    assert got.data_ptr() == out.data_ptr() and got.shape == (1, rows), got.shape
    want = x.double() @ w.T
    eps = torch.finfo(x.dtype).eps
    bound = 1e-5 * (x.double().abs() @ w.abs().T) + 2 * eps * want.abs()
    err = (got.double() - want).abs()
    bad = ~(err <= bound)
    assert not bad.any(), (
        f"{what} {rows}x{cols}: {int(bad.sum())} wrong elements, first at "
        f"{bad.nonzero()[0].tolist()}: got {got.double()[bad][0]:.6g}, want {want[bad][0]:.6g}"
    )
    if split_k > 1:
        counters, _ = qp._scratch(x.device, 1, 1)
        assert not counters.any(), "the split launch left arrival counters set"
        again = qp.packed_gemv(x, packed, launch=launch)
        assert torch.equal(again, got), "a second run gave other bits"
    return got
