"""FP8 (e4m3) products of a few rows: ``[M, K] x [N, K]^T`` for up to :data:`MAX_ROWS` rows.

An FP8 projection quantises its input rows per token (or with a static scale)
and multiplies them by its e4m3 weight with one float32 scale per output
column. At a few rows the product streams the weight, and what it costs is how
fast the weight is read. ``torch._scaled_mm`` (cuBLAS) tiles the output in
blocks of 128 columns, so a 4,096-wide projection is 32 programs on an H100's
132 multiprocessors: at 19 rows the 8B shape's projections read their 7 GB at
about 1.8 TB/s, against the 3 TB/s the device streams.

Here the output is tiled in :data:`BLOCK_N` columns and row blocks of 16 or
32, and the reduction split along K until about two programs run per
multiprocessor (:func:`plan`, chosen from ``benchmarks/fp8_few_rows.py
--sweep``). Each program multiplies its rows' chunks with its weight tiles on
the tensor cores (the e4m3 values widened to float16, exact products, float32
sums), pipelined; the row blocks that read one weight tile run side by side,
so all but the first find it in L2. With several splits each program stores a
float32 partial, and the program that arrives last at its tile adds them in
split order (deterministic) and applies the scales and the bias (see
:mod:`backplane.kernels.split_k`).

Past 32 rows cuBLAS's tiles fill a device once the weight has enough columns,
so those rows come here only for weights that leave three quarters of the
multiprocessors without a tile (:func:`supports`): on an H100 at 48 and 64
rows, the 8B shape's o projection takes 13.2-13.6 us against cuBLAS's
13.7-14.0 and its down projection 34.1-34.6 against 38.0-39.5, while q/k/v and
gate/up are faster in cuBLAS.

The weight must be ``N % BLOCK_N == 0`` and ``K % BLOCK_K == 0``, which every
projection of the published shapes is. Needs compute capability 8.9 (e4m3
products); the interpreter runs it on CPU tensors (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from backplane.core.launch import KernelLauncher, arg_key, cdiv
from backplane.kernels.split_k import scratch as _scratch

__all__ = ["BLOCK_K", "BLOCK_N", "MAX_ROWS", "Launch", "plan", "scaled_mm", "supports"]

#: the most rows this kernel takes; more go to ``torch._scaled_mm`` (on an H100 at
#: 128 rows cuBLAS reads every 8B projection faster). Up to 32 rows for any weight,
#: past that for narrow ones only (:func:`supports`)
MAX_ROWS = 64

#: the most rows for a weight wide enough to give cuBLAS's 128-column tiles to at
#: least a quarter of the multiprocessors
WIDE_MAX_ROWS = 32

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
    m_blocks,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One row block's product with one column block over one split of K; the last split's
    program finishes it."""
    # Row blocks vary fastest: the programs that read one weight tile run side by
    # side, and all but the first find it in L2.
    pid = tl.program_id(0)
    pid_m = pid % m_blocks
    pid_n = pid // m_blocks
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
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
        rows = m_blocks * BLOCK_M
        parts = part_ptr + (pid_k * rows + rm)[:, None] * N + rn[None, :]
        tl.store(parts, acc)
        # Every thread's partial stores come before the (releasing) arrival.
        tl.debug_barrier()
        counter = count_ptr + pid
        if tl.atomic_add(counter, 1, sem="acq_rel") == split_k - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            # In split order, whichever program arrives last: the same sums every
            # run. Loads bypass L1 (".cg"): other multiprocessors wrote them.
            for s in range(0, split_k):
                acc += tl.load(
                    part_ptr + (s * rows + rm)[:, None] * N + rn[None, :],
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
    :return: ``True`` for a weight of whole :data:`BLOCK_N` x :data:`BLOCK_K`
        tiles and 1 to :data:`WIDE_MAX_ROWS` rows, or up to :data:`MAX_ROWS`
        where cuBLAS's 128-column tiles would leave three quarters of the
        multiprocessors idle.
    """
    n, k = weight.shape
    # the device's multiprocessors are looked up only past WIDE_MAX_ROWS (every call
    # of an FP8 projection of a few rows asks)
    narrow = rows <= WIDE_MAX_ROWS or n // 128 < _sms(weight.device) // 4
    return (
        0 < rows <= MAX_ROWS
        and narrow
        and n % BLOCK_N == 0
        and k % BLOCK_K == 0
        and weight.stride(1) == 1
        and weight.dtype == torch.float8_e4m3fn
    )


class Launch(NamedTuple):
    """How one product is tiled and launched (see :func:`plan`)."""

    #: rows per program: 16 or 32 (the tensor cores' smallest tile is 16 rows; from 64
    #: rows a tile takes Hopper's e4m3 instructions, whose sums lose precision)
    block_m: int
    #: output columns per program
    block_n: int
    #: reduction columns per pipelined step
    block_k: int
    #: programs along K
    split_k: int
    #: reduction columns per split (whole ``block_k`` steps)
    k_per_split: int
    num_warps: int
    num_stages: int


def split_plan(
    n: int, k: int, sms: int, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
    programs: float = PROGRAMS_PER_SM, row_blocks: int = 1,
) -> tuple[int, int]:  # fmt: skip
    """How a ``[N, K]`` weight's reduction is split: ``(split_k, k_per_split)``.

    As many splits as bring the programs to about ``programs`` per
    multiprocessor, each a whole number of ``block_k`` steps.

    :param n: output columns.
    :param k: reduction length.
    :param sms: the device's multiprocessors.
    :param block_n: output columns per program.
    :param block_k: reduction columns per step.
    :param programs: programs per multiprocessor to aim at.
    :param row_blocks: programs along the rows (they read the same weight tiles).
    :return: the split count and the columns each split reduces.
    """
    steps = k // block_k
    want = max(1, min(steps, round(programs * sms / (n // block_n * row_blocks))))
    k_per_split = cdiv(steps, want) * block_k
    return cdiv(k, k_per_split), k_per_split


@functools.lru_cache(maxsize=1024)
def plan(m: int, n: int, k: int, sms: int) -> Launch:
    """The launch of an ``[m, K] x [N, K]^T`` product on a device of ``sms`` multiprocessors.

    :param m: input rows (1 to :data:`MAX_ROWS`).
    :param n: output columns (whole :data:`BLOCK_N` blocks).
    :param k: reduction length (whole :data:`BLOCK_K` steps).
    :param sms: the device's multiprocessors.
    :return: the launch (kept per argument set: every projection call asks).
    """
    # Past 32 rows, row blocks of 32 that share each weight tile through L2. Deeper
    # steps (256 columns, five stages) and launches as programmatic dependents were
    # faster on an H100 and slower on an H200 (``benchmarks/fp8_few_rows.py --sweep``).
    block_m = 16 if m <= 16 else 32
    split_k, k_per_split = split_plan(
        n, k, sms, BLOCK_N, BLOCK_K, PROGRAMS_PER_SM, cdiv(m, block_m)
    )
    return Launch(block_m, BLOCK_N, BLOCK_K, split_k, k_per_split, 4, 4)


def scaled_mm(
    qx: torch.Tensor,
    weight: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    launch: Launch | None = None,
) -> torch.Tensor:
    """``(qx @ weight^T) * scale_a * scale_b^T + bias`` in ``out_dtype``, for a few rows.

    :param qx: the quantised input ``[M, K]`` (e4m3, rows contiguous).
    :param weight: the e4m3 weight ``[N, K]`` (see :func:`supports`).
    :param scale_a: float32, one per input row (``[M]`` or ``[M, 1]``).
    :param scale_b: float32, one per output column (``N`` elements).
    :param bias: ``[N]`` or ``None``.
    :param out_dtype: the output's dtype.
    :param launch: the tiling, for benchmarks (default: :func:`plan`'s); its
        blocks must divide ``N`` and ``K``.
    :return: ``[M, N]``.
    """
    m, k = qx.shape
    n = weight.shape[0]
    if not supports(m, weight) or qx.stride(1) != 1 or weight.shape[1] != k:
        raise ValueError(
            f"fp8_few_rows.scaled_mm takes 1..{WIDE_MAX_ROWS} rows ({MAX_ROWS} for a weight of "
            f"few columns, see supports()) against an e4m3 weight of whole {BLOCK_N}x{BLOCK_K} "
            f"tiles; got input {tuple(qx.shape)}, weight {tuple(weight.shape)}"
        )
    if launch is None:
        launch = plan(m, n, k, _sms(qx.device))
    m_blocks = cdiv(m, launch.block_m)
    n_blocks = n // launch.block_n
    split = launch.split_k > 1
    y = torch.empty(m, n, dtype=out_dtype, device=qx.device)
    counters, parts = _scratch(
        qx.device,
        n_blocks * m_blocks,
        launch.split_k * m_blocks * launch.block_m * n if split else 0,
    )
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
        launch.k_per_split,
        launch.split_k,
        m_blocks,
        qx.stride(0),
        weight.stride(0),
        y.stride(0),
    )
    index = qx.device.index if qx.is_cuda else 0
    _LAUNCHER(
        (launch, arg_key(args)),
        (n_blocks * m_blocks, launch.split_k),
        args,
        index,
        HAS_BIAS=bias is not None,
        SPLIT=split,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return y
