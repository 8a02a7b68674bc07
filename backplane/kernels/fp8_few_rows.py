"""FP8 (e4m3) products of a few rows: ``[M, K] x [N, K]^T`` for up to :data:`MAX_ROWS` rows.

An FP8 projection quantises its input rows per token (or with a static scale)
and multiplies them by its e4m3 weight with one float32 scale per output
column. At a few rows the product streams the weight, and what it costs is how
fast the weight is read. ``torch._scaled_mm`` (cuBLAS) tiles the output in
blocks of 128 columns, so a 4,096-wide projection is 32 programs on an H100's
132 multiprocessors: at 19 rows the 8B shape's projections read their 7 GB at
about 1.8 TB/s, against the 3 TB/s the device streams.

Here the output is tiled in :data:`BLOCK_N` columns and the reduction split
along K until about two programs run per multiprocessor. Each program
multiplies its rows' chunks with its weight tiles on the tensor cores (the e4m3
values widened to float16, exact products, float32 sums), pipelined; with several splits each stores a float32 partial,
and the program that arrives last at its column block adds them in split order
(deterministic) and applies the scales and the bias (see
:mod:`backplane.kernels.split_k`).

The row count is padded to a power of two of at least 16 (the tensor cores'
smallest tile); the weight must be ``N % BLOCK_N == 0`` and ``K % BLOCK_K ==
0``, which every projection of the published shapes is (:func:`supports`).
Needs compute capability 8.9 (e4m3 products); the interpreter runs it on CPU
tensors (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backplane.core.launch import KernelLauncher, arg_key, cdiv, next_pow2
from backplane.kernels.split_k import scratch as _scratch

__all__ = ["BLOCK_K", "BLOCK_N", "MAX_ROWS", "scaled_mm", "supports"]

#: the most rows this kernel takes; more go to ``torch._scaled_mm``. Up to 32 rows
#: the products run on float16 tensor-core instructions (the e4m3 values widened,
#: every product exact, float32 sums); a 64-row tile takes Hopper's e4m3 instructions,
#: whose sums lose precision (1e-2 relative seen on an H100) and which read no faster
MAX_ROWS = 32

#: output columns per program
BLOCK_N = 64

#: reduction columns per pipelined step (an e4m3 weight tile of 8 KiB)
BLOCK_K = 128

#: programs per multiprocessor the split along K aims at
PROGRAMS_PER_SM = 2


@triton.jit
def _few_rows_kernel(
    x_ptr,
    w_ptr,
    sa_ptr,
    sb_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    k_per_split,
    split_k,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One column block's product over one split of K; the last split's program finishes it."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # Every split holds whole BLOCK_K steps (the last may hold fewer) and N whole
    # column blocks (the host checks).
    for k0 in range(k_start, k_end, BLOCK_K):
        x = tl.load(x_rows + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_rows + (k0 + rk)[None, :])
        acc = tl.dot(x, tl.trans(w), acc)
    if SPLIT:
        parts = part_ptr + (pid_k * BLOCK_M + rm)[:, None] * N + rn[None, :]
        tl.store(parts, acc)
        # Every thread's partial stores come before the (releasing) arrival.
        tl.debug_barrier()
        counter = count_ptr + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == split_k - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            # In split order, whichever program arrives last: the same sums every
            # run. Loads bypass L1 (".cg"): other multiprocessors wrote them.
            for s in range(0, split_k):
                acc += tl.load(
                    part_ptr + (s * BLOCK_M + rm)[:, None] * N + rn[None, :],
                    cache_modifier=".cg",
                )
            _finish(acc, sa_ptr, sb_ptr, b_ptr, y_ptr, rm, rn, m_ok, stride_ym, HAS_BIAS)
            tl.atomic_xchg(counter, 0)
    else:
        _finish(acc, sa_ptr, sb_ptr, b_ptr, y_ptr, rm, rn, m_ok, stride_ym, HAS_BIAS)


@triton.jit
def _finish(acc, sa_ptr, sb_ptr, b_ptr, y_ptr, rm, rn, m_ok, stride_ym, HAS_BIAS: tl.constexpr):
    """Scale the float32 sums by their row's and column's scales, add the bias, store."""
    sa = tl.load(sa_ptr + rm, mask=m_ok, other=0.0)
    sb = tl.load(sb_ptr + rn)
    y = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None],
    )


_LAUNCHER = KernelLauncher(_few_rows_kernel)

#: multiprocessors per CUDA device index
_SMS: dict[int, int] = {}


def _sms(device: torch.device) -> int:
    """The multiprocessors the split is planned for (4 off CUDA, for the interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SMS.get(index)
    if count is None:
        count = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def supports(rows: int, weight: torch.Tensor) -> bool:
    """Whether :func:`scaled_mm` takes ``rows`` input rows against ``weight``.

    :param rows: the input's rows.
    :param weight: the e4m3 weight ``[N, K]``, its rows contiguous.
    :return: ``True`` for 1 to :data:`MAX_ROWS` rows and a weight of whole
        :data:`BLOCK_N` x :data:`BLOCK_K` tiles.
    """
    n, k = weight.shape
    return (
        0 < rows <= MAX_ROWS
        and n % BLOCK_N == 0
        and k % BLOCK_K == 0
        and weight.stride(1) == 1
        and weight.dtype == torch.float8_e4m3fn
    )


def split_plan(n: int, k: int, sms: int) -> tuple[int, int]:
    """How a ``[N, K]`` weight's reduction is split: ``(split_k, k_per_split)``.

    As many splits as bring the programs to about :data:`PROGRAMS_PER_SM` per
    multiprocessor, each a whole number of :data:`BLOCK_K` steps.

    :param n: output columns.
    :param k: reduction length.
    :param sms: the device's multiprocessors.
    :return: the split count and the columns each split reduces.
    """
    steps = k // BLOCK_K
    want = max(1, min(steps, round(PROGRAMS_PER_SM * sms / (n // BLOCK_N))))
    k_per_split = cdiv(steps, want) * BLOCK_K
    return cdiv(k, k_per_split), k_per_split


def scaled_mm(
    qx: torch.Tensor,
    weight: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(qx @ weight^T) * scale_a * scale_b^T + bias`` in ``out_dtype``, for a few rows.

    :param qx: the quantised input ``[M, K]`` (e4m3, rows contiguous).
    :param weight: the e4m3 weight ``[N, K]`` (see :func:`supports`).
    :param scale_a: float32, one per input row (``[M]`` or ``[M, 1]``).
    :param scale_b: float32, one per output column (``N`` elements).
    :param bias: ``[N]`` or ``None``.
    :param out_dtype: the output's dtype.
    :return: ``[M, N]``.
    """
    m, k = qx.shape
    n = weight.shape[0]
    if not supports(m, weight) or qx.stride(1) != 1 or weight.shape[1] != k:
        raise ValueError(
            f"fp8_few_rows.scaled_mm takes 1..{MAX_ROWS} rows against an e4m3 weight of whole "
            f"{BLOCK_N}x{BLOCK_K} tiles; got input {tuple(qx.shape)}, weight {tuple(weight.shape)}"
        )
    block_m = max(16, next_pow2(m))
    split_k, k_per_split = split_plan(n, k, _sms(qx.device))
    y = torch.empty(m, n, dtype=out_dtype, device=qx.device)
    counters, parts = _scratch(qx.device, n // BLOCK_N, split_k * block_m * n if split_k > 1 else 0)
    args = (
        qx,
        weight,
        # one float32 each, contiguous (a static input scale comes expanded)
        scale_a.reshape(-1).float().contiguous(),
        scale_b.reshape(-1).float().contiguous(),
        weight if bias is None else bias,
        y,
        parts,
        counters,
        m,
        n,
        k,
        k_per_split,
        split_k,
        qx.stride(0),
        weight.stride(0),
        y.stride(0),
    )
    _LAUNCHER(
        (block_m, arg_key(args)),
        (n // BLOCK_N, split_k),
        args,
        qx.device.index if qx.is_cuda else 0,
        HAS_BIAS=bias is not None,
        SPLIT=split_k > 1,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
        num_stages=4,
    )
    return y
