"""A one-row product with a repacked Q6_K weight (:mod:`.q6k_layout`), for batch-1 decode.

Q6_K is what llama.cpp's Q4_K_M files store the LM head in, and half of the
``attn_v`` and ``ffn_down`` projections. Read as ggml's blocks
(:mod:`.qgemv`) the 8B LM head runs at about a quarter of the memory
bandwidth; this kernel reads the layout of
:class:`~backplane.kernels.q6k_layout.PackedQ6K` the way
:func:`~backplane.kernels.qgemv_packed.packed_gemv` reads repacked Q4_K, with
the same launch structure (:class:`~backplane.kernels.qgemv_packed.Launch`):

- a program owns a chunk of ``BLOCK_K`` inputs (whole 256-value
  super-blocks) and a run of output rows; it keeps its chunk of ``x`` in
  float32 registers and walks its rows ``BLOCK_N`` at a time, each row tile
  loaded ``prefetch`` iterations ahead, launching as a programmatic dependent
  on Hopper; split-K partials are added by the program arriving last at its
  run of rows (:func:`~backplane.kernels.split_k.sum_parts`, arrival counters
  left at zero): one launch, replayable in a CUDA graph, deterministic;
- a thread takes the two groups of a ``qh`` pair (groups ``a`` and ``a + 4``
  of one super-block, see :mod:`.q6k_layout`): two 16-byte loads of low
  nibbles, one of high bit pairs, one 32-bit load of the four sub-block
  scales and one of ``d``. Its 64 quants are six-bit fields formed in place:
  the low nibble masked in its ``ql`` word, ORed with the high pair masked in
  the ``qh`` word shifted to sit just above it (two ``LOP3`` a weight; the
  upper four nibble positions of each word are shifted down 12 bits first,
  so every field stays below bit 24). As in :mod:`.qgemv_packed`, a float32
  bit pattern below 2**24 is worth ``pattern * 2**-149``, so the field *is*
  the float ``q * 2**(P - 149)`` (``P`` the bit it starts at) and one
  multiply-add with the input, scaled by ``2**(64 - P)`` when it was loaded,
  adds ``q * x * 2**-85``. Per thread-weight that is two ``LOP3``, one
  ``FFMA`` and 3/8 of a shift; its planned loop counts 0.164
  warp-instructions per byte of Q6_K in its sm_90 SASS, against 0.194 for
  the Q4_K kernel per byte of Q4_K (``benchmarks/qgemv_sass.py
  --packed-q6k``, ``--packed``; 128 registers a thread, no spills);
- each 16-value sub-block's chain of multiply-adds starts at ``-32 * sum(x)``
  (scaled alike), so it ends at ``dot(q - 32, x)``; the thread's four chains
  are weighted by their scales and the sum by ``d``: ``d * sum_j sc_j *
  dot(q_j - 32, x_j)``, the row's chunk sum coming from a sum over the row's
  threads.

Inputs must be finite and below 2**64 in magnitude (the scaled copies
overflow beyond); products below about 2**-41 keep an absolute accuracy of
2**-64 instead of a relative one.

Several input rows expand the weight first: :func:`dequantize_packed_matrix`
writes it in the input's dtype, value by value with ggml's arithmetic
(``(d * scale) * (q - 32)``), for the caller to multiply (and drop).

The launch :func:`plan` makes is the packed Q4_K kernel's, measured fastest
there; it has not been measured for Q6_K on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backplane.core import compile_ahead
from backplane.core.launch import cdiv, dependent_launch
from backplane.kernels import qgemv_packed
from backplane.kernels.q6k_layout import QK_K, PackedQ6K
from backplane.kernels.qgemv_packed import (
    DTYPES,
    Launch,
    _group_x,
    _load,
    _row_and_output,
    _sm_count,
    _split4,
    _store_tile,
    _sum_splits,
)
from backplane.kernels.split_k import scratch as _scratch

__all__ = [
    "DTYPES",
    "Launch",
    "dequantize_packed_matrix",
    "packed_gemv",
    "plan",
    "supports",
]

#: default launch (see :func:`plan`): rows per iteration, largest chunk of inputs per
#: program, warps, row tiles loaded ahead, programs per multiprocessor (the Q4_K
#: kernel's measured launch, a starting point for Q6_K)
_BLOCK_N = 2
_BLOCK_K = 1024
_WARPS = 1
_PREFETCH = 1
_PROGRAMS_PER_SM = 16

#: rows and values per program of the dequantising kernel
_DQ_BLOCK_N = 16
_DQ_BLOCK_K = 256


@triton.jit
def _q6(lo, hi, P: tl.constexpr):
    """The six-bit quant whose low nibble is at bit ``P`` of ``lo`` and whose high pair is at
    bit ``P + 4`` of ``hi``, as the float32 ``q * 2**(P - 149)``, exactly (``P + 6 <= 24``).

    Two ``LOP3`` (the mask of the nibble, then the OR with the masked pair), no
    conversion: the bit pattern is below 2**24, so it is read as ``pattern * 2**-149``.
    """
    v = (lo & (0xF << P)) | (hi & (0x30 << P))
    return v.to(tl.float32, bitcast=True)


@triton.jit
def _word_dot(l0, l1, l2, l3, h0, h1, h2, h3, xs, P: tl.constexpr, acc):
    """``acc`` plus the quant at bit ``P`` of each of the four word pairs times its input
    (``xs [G, 4]``, split as :func:`~backplane.kernels.qgemv_packed._split4` splits words)."""
    x0, x1, x2, x3 = _split4(xs)
    acc += _q6(l0, h0, P) * x0[None, :]
    acc += _q6(l1, h1, P) * x1[None, :]
    acc += _q6(l2, h2, P) * x2[None, :]
    acc += _q6(l3, h3, P) * x3[None, :]
    return acc


@triton.jit
def _sub_block(l0, l1, l2, l3, h0, h1, h2, h3, x0, x1, x2, x3, xsum, P0: tl.constexpr):
    """``dot(q - 32, x) * 2**-85`` of one 16-value sub-block of each row of a tile,
    ``[BLOCK_N, G]``: its four nibble positions start at bits ``P0``, ``P0 + 4``, ...
    of the low words ``l*`` (high pairs four bits above, in ``h*``); ``xsum`` is
    ``-32 * sum(x) * 2**-85``."""
    acc = _word_dot(l0, l1, l2, l3, h0, h1, h2, h3, x0, P0, xsum)
    acc = _word_dot(l0, l1, l2, l3, h0, h1, h2, h3, x1, P0 + 4, acc)
    acc = _word_dot(l0, l1, l2, l3, h0, h1, h2, h3, x2, P0 + 8, acc)
    acc = _word_dot(l0, l1, l2, l3, h0, h1, h2, h3, x3, P0 + 12, acc)
    return acc


@triton.jit
def _resident_x(x_ptr, k_g, w, g_ok, EVEN_K: tl.constexpr):
    """The inputs of groups ``k_g`` (first values), each nibble position's four as float32
    ``[G, 4]`` scaled by ``2**(64 - P)`` (``P`` where :func:`_pair_part` finds that
    position's quant: ``4 * S`` for ``S < 4``, ``4 * S - 12`` above), and each
    sub-block's sum ``[1, G]`` times ``-32 * 2**-85``, where its chain starts.

    Products then come out as ``q * x * 2**-85``, as in :mod:`.qgemv_packed`.
    """
    x0, x1, x2, x3, x4, x5, x6, x7 = _group_x(x_ptr, k_g, w, g_ok, EVEN_K)
    sum0 = tl.sum((x0 + x1) + (x2 + x3), axis=1)[None, :]
    sum1 = tl.sum((x4 + x5) + (x6 + x7), axis=1)[None, :]
    # 2**(64 - P) for P = 0, 4, 8, 12, 4, 8, 12, 16; -32 * 2**-85 = -2**-80
    return (
        x0 * 18446744073709551616.0,
        x1 * 1152921504606846976.0,
        x2 * 72057594037927936.0,
        x3 * 4503599627370496.0,
        x4 * 1152921504606846976.0,
        x5 * 72057594037927936.0,
        x6 * 4503599627370496.0,
        x7 * 281474976710656.0,
        sum0 * -8.271806125530277e-25,
        sum1 * -8.271806125530277e-25,
    )


@triton.jit
def _pair_part(
    la, lb, h, sc, d,
    xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7, sa0, sa1,
    xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7, sb0, sb1,
):  # fmt: skip
    """Each row's sum over each pair of groups of a tile (:func:`_row_tile`), ``[BLOCK_N, G]``,
    times ``2**-85``: ``d * sum_j sc_j * dot(q_j - 32, x_j)`` over the pair's four sub-blocks."""
    la0, la1, la2, la3 = _split4(la)
    lb0, lb1, lb2, lb3 = _split4(lb)
    h0, h1, h2, h3 = _split4(h)
    # Nibble positions 0..3 (the first sub-block of a group) are read in place, 4..7 shifted
    # down 12 bits: every six-bit field then ends by bit 21. The first group's high pair of
    # position S sits at bit 4S of the qh word, its partner's at 4S + 2: each word is
    # shifted to put the pair 4 bits above its nibble.
    acc_a0 = _sub_block(
        la0, la1, la2, la3, h0 << 4, h1 << 4, h2 << 4, h3 << 4, xa0, xa1, xa2, xa3, sa0, 0
    )
    acc_a1 = _sub_block(
        la0 >> 12, la1 >> 12, la2 >> 12, la3 >> 12, h0 >> 8, h1 >> 8, h2 >> 8, h3 >> 8,
        xa4, xa5, xa6, xa7, sa1, 4,
    )  # fmt: skip
    acc_b0 = _sub_block(
        lb0, lb1, lb2, lb3, h0 << 2, h1 << 2, h2 << 2, h3 << 2, xb0, xb1, xb2, xb3, sb0, 0
    )
    acc_b1 = _sub_block(
        lb0 >> 12, lb1 >> 12, lb2 >> 12, lb3 >> 12, h0 >> 10, h1 >> 10, h2 >> 10, h3 >> 10,
        xb4, xb5, xb6, xb7, sb1, 4,
    )  # fmt: skip
    # the four int8 scales of the pair, sign-extended (arithmetic shifts of the int32 word)
    s0 = ((sc << 24) >> 24).to(tl.float32)
    s1 = ((sc << 16) >> 24).to(tl.float32)
    s2 = ((sc << 8) >> 24).to(tl.float32)
    s3 = (sc >> 24).to(tl.float32)
    return d.to(tl.float32) * (((s0 * acc_a0) + (s1 * acc_a1)) + ((s2 * acc_b0) + (s3 * acc_b1)))


@triton.jit
def _row_tile(
    ql_row,
    qh_row,
    sc_row,
    d_row,
    ql_off,
    qh_off,
    sc_off,
    d_off,
    ahead,
    m2,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN: tl.constexpr,
):
    """The row tile ``ahead`` tiles after the one at the row pointers: per pair of groups
    the first group's and the partner's low words and the high words ``[BLOCK_N, G, 4]``,
    the scale word and ``d`` ``[BLOCK_N, G]`` (zero where ``m2`` is false)."""
    ql_at = ql_row + ahead * (BLOCK_N * (K // 8))
    qh_at = qh_row + ahead * (BLOCK_N * (K // 16))
    sc_at = sc_row + ahead * (BLOCK_N * (K // 64))
    d_at = d_row + ahead * (BLOCK_N * (K // 256))
    m3 = m2[:, :, None]
    la = _load(ql_at + ql_off, m3, EVEN)
    lb = _load(ql_at + ql_off + 16, m3, EVEN)  # the partner: four groups on
    h = _load(qh_at + qh_off, m3, EVEN)
    sc = _load(sc_at + sc_off, m2, EVEN)
    d = _load(d_at + d_off, m2, EVEN)
    return la, lb, h, sc, d


@triton.jit
def _packed_q6k_gemv_kernel(
    x_ptr,
    ql_ptr,
    qh_ptr,
    sc_ptr,
    d_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    N,
    rows_per_program,
    split_k,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    SPLITS: tl.constexpr,
    TAIL_N: tl.constexpr,
    STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if PDL:
        # The next kernel's programs may be scheduled once all of these run.
        tl.extra.cuda.gdc_launch_dependents()
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    EVEN: tl.constexpr = EVEN_N and EVEN_K
    # pairs of groups a thread takes of each row: pair p is groups 8b + j and 8b + j + 4
    # of super-block b = p // 4 (j = p % 4)
    G: tl.constexpr = BLOCK_K // 64
    p = pid_k * G + tl.arange(0, G)
    w = tl.arange(0, 4)
    group_a = 8 * (p // 4) + p % 4
    ka = group_a * 32
    kb = ka + 128
    p_ok = p * 64 < K
    row_start = pid_n * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, N)
    # int32 offsets within a row tile, int64 row tile bases moved BLOCK_N rows an iteration
    r = tl.arange(0, BLOCK_N)
    ql_off = r[:, None, None] * (K // 8) + ((group_a * 4)[None, :, None] + w[None, None, :])
    qh_off = r[:, None, None] * (K // 16) + ((p * 4)[None, :, None] + w[None, None, :])
    sc_off = r[:, None] * (K // 64) + p[None, :]
    d_off = r[:, None] * (K // 256) + (p // 4)[None, :]
    ql_row = ql_ptr + row_start.to(tl.int64) * (K // 8)
    qh_row = qh_ptr + row_start.to(tl.int64) * (K // 16)
    sc_row = sc_ptr + row_start.to(tl.int64) * (K // 64)
    d_row = d_ptr + row_start.to(tl.int64) * (K // 256)
    p_ok2 = p_ok[None, :]
    if PREFETCH > 0:
        # The first PREFETCH row tiles; each iteration then loads the one PREFETCH
        # tiles ahead before multiplying its own, so a program always has that
        # many tiles' loads in flight.
        n1 = _row_tile(
            ql_row, qh_row, sc_row, d_row, ql_off, qh_off, sc_off, d_off, 0,
            (row_start + r < row_end)[:, None] & p_ok2, K, BLOCK_N, False,
        )  # fmt: skip
        if PREFETCH > 1:
            n2 = _row_tile(
                ql_row, qh_row, sc_row, d_row, ql_off, qh_off, sc_off, d_off, 1,
                (row_start + BLOCK_N + r < row_end)[:, None] & p_ok2, K, BLOCK_N, False,
            )  # fmt: skip
    if PDL:
        # Everything below reads (or writes what may still be read by) the kernels
        # before; the weights are no kernel's output, so the first tiles' loads
        # overlap the previous kernel's tail.
        tl.extra.cuda.gdc_wait()
    # This program's inputs, kept for all its rows.
    xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7, sa0, sa1 = _resident_x(x_ptr, ka, w, p_ok, EVEN_K)
    xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7, sb0, sb1 = _resident_x(x_ptr, kb, w, p_ok, EVEN_K)
    # Partial sums are stored from the first lane of each row's threads (see qgemv_packed).
    first = (tl.arange(0, G) == 0)[None, :]
    if SPLITS:
        out_off = (row_start + r[:, None]) * split_k + pid_k + 0 * p[None, :]
    else:
        out_off = row_start + r[:, None] + 0 * p[None, :]
    for r0 in tl.range(row_start, row_end, BLOCK_N, num_stages=STAGES):
        r_ok = (r0 + r < row_end)[:, None]
        if PREFETCH > 0:
            la, lb, h, sc, d = n1
            ahead_ok = (r0 + PREFETCH * BLOCK_N + r < row_end)[:, None] & p_ok2
            if PREFETCH > 1:
                n1 = n2
                n2 = _row_tile(
                    ql_row, qh_row, sc_row, d_row, ql_off, qh_off, sc_off, d_off, 2, ahead_ok,
                    K, BLOCK_N, False,
                )  # fmt: skip
            else:
                n1 = _row_tile(
                    ql_row, qh_row, sc_row, d_row, ql_off, qh_off, sc_off, d_off, 1, ahead_ok,
                    K, BLOCK_N, False,
                )  # fmt: skip
        else:
            la, lb, h, sc, d = _row_tile(
                ql_row, qh_row, sc_row, d_row, ql_off, qh_off, sc_off, d_off, 0, r_ok & p_ok2,
                K, BLOCK_N, EVEN,
            )  # fmt: skip
        part = _pair_part(
            la, lb, h, sc, d,
            xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7, sa0, sa1,
            xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7, sb0, sb1,
        )  # fmt: skip
        store = first if EVEN_N else first & r_ok
        _store_tile(part, y_ptr, part_ptr, out_off, store, SPLITS)
        out_off += BLOCK_N * split_k if SPLITS else BLOCK_N
        ql_row += BLOCK_N * (K // 8)
        qh_row += BLOCK_N * (K // 16)
        sc_row += BLOCK_N * (K // 64)
        d_row += BLOCK_N * (K // 256)
    if SPLITS:
        _sum_splits(y_ptr, part_ptr, count_ptr + pid_n, row_start, row_end, split_k, SPLITS, TAIL_N)


@triton.jit
def _dequant_packed_q6k_kernel(
    ql_ptr,
    qh_ptr,
    sc_ptr,
    d_ptr,
    out_ptr,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    G: tl.constexpr = BLOCK_K // 64
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    p = tl.program_id(1) * G + tl.arange(0, G)
    w = tl.arange(0, 4)
    group_a = 8 * (p // 4) + p % 4
    m2 = (rows < N)[:, None] & (p * 64 < K)[None, :]
    m3 = m2[:, :, None]
    r64 = rows.to(tl.int64)[:, None]
    ql = ql_ptr + r64[:, :, None] * (K // 8) + ((group_a * 4)[None, :, None] + w[None, None, :])
    la = tl.load(ql, mask=m3, other=0)
    lb = tl.load(ql + 16, mask=m3, other=0)
    qh = qh_ptr + r64[:, :, None] * (K // 16) + ((p * 4)[None, :, None] + w[None, None, :])
    h = tl.load(qh, mask=m3, other=0)
    sc = tl.load(sc_ptr + r64 * (K // 64) + p[None, :], mask=m2, other=0)
    d = tl.load(d_ptr + r64 * (K // 256) + (p // 4)[None, :], mask=m2, other=0).to(tl.float32)
    # ggml's arithmetic and rounding: (d * scale) * (q - 32), scale an int8
    scale_a0 = (d * ((sc << 24) >> 24).to(tl.float32))[:, :, None]
    scale_a1 = (d * ((sc << 16) >> 24).to(tl.float32))[:, :, None]
    scale_b0 = (d * ((sc << 8) >> 24).to(tl.float32))[:, :, None]
    scale_b1 = (d * (sc >> 24).to(tl.float32))[:, :, None]
    out = out_ptr + r64[:, :, None] * K + ((group_a * 32)[None, :, None] + w[None, None, :])
    for s in tl.static_range(8):
        qa = ((la >> (4 * s)) & 0xF) | (((h >> (4 * s)) & 3) << 4)
        qb = ((lb >> (4 * s)) & 0xF) | (((h >> (4 * s + 2)) & 3) << 4)
        if s < 4:
            va = scale_a0 * (qa - 32).to(tl.float32)
            vb = scale_b0 * (qb - 32).to(tl.float32)
        else:
            va = scale_a1 * (qa - 32).to(tl.float32)
            vb = scale_b1 * (qb - 32).to(tl.float32)
        tl.store(out + 4 * s, va.to(out_ptr.dtype.element_ty), mask=m3)
        tl.store(out + 128 + 4 * s, vb.to(out_ptr.dtype.element_ty), mask=m3)


def supports(in_features: int, dtype: torch.dtype) -> bool:
    """Whether :func:`packed_gemv` runs rows of ``in_features`` values for an input of ``dtype``.

    :param in_features: values per weight row.
    :param dtype: the input's dtype.
    :return: whole Q6_K blocks per row and a dtype of :data:`DTYPES`.
    """
    return in_features % QK_K == 0 and in_features > 0 and dtype in DTYPES


def packed_gemv(
    x: torch.Tensor,
    packed: PackedQ6K,
    out: torch.Tensor | None = None,
    launch: Launch | None = None,
) -> torch.Tensor:
    """``x @ dequant(packed).T`` for one input row, dequantising in the kernel.

    :param x: ``[1, K]`` (or ``[K]``), on the weight's device, a dtype of :data:`DTYPES`.
    :param packed: the weight ``[N, K]`` (see :func:`~backplane.kernels.q6k_layout.repack_q6k`).
    :param out: where to write the row (``[1, N]``, contiguous, ``x``'s dtype and device);
        a new tensor when ``None``.
    :param launch: a :class:`Launch` instead of :func:`plan`'s (tuning): two groups a
        thread, a chunk of whole super-blocks.
    :return: ``[1, N]`` in ``x``'s dtype (``out`` when given).
    :raises ValueError: a width or dtype :func:`supports` refuses, tensors not laid out
        as :class:`~backplane.kernels.q6k_layout.PackedQ6K` says, an input that is not one
        row of ``K`` values, an ``out`` that does not fit, or a launch the kernel cannot run.
    """
    n, k = _check(packed)
    if not supports(k, x.dtype):
        raise ValueError(
            f"the packed Q6_K kernel does not run rows of {k} values in {x.dtype}; "
            "dequantise the weight instead"
        )
    xr, y = _row_and_output(x, k, n, out)
    grid, ints, constexprs = _launch(n, k, _sm_count(x.device), launch)
    if x.is_cuda and dependent_launch(x.device.index if x.device.index is not None else 0):
        constexprs.update(PDL=True, launch_pdl=True)
    split_k = grid[1]
    counters, part = _scratch(x.device, grid[0], split_k * n) if split_k > 1 else (y, y)
    compile_ahead.launch(
        _packed_q6k_gemv_kernel,
        grid,
        xr,
        packed.ql,
        packed.qh,
        packed.scales.view(torch.int32),
        packed.d,
        y,
        part,
        counters,
        *ints,
        **constexprs,
    )
    return y


def _check(packed: PackedQ6K) -> tuple[int, int]:
    """Refuse tensors the kernels would misread (they assume contiguous rows); return
    ``(N, K)``."""
    n, k = packed.shape
    expected = (
        (packed.ql, torch.int32, k // 8),
        (packed.qh, torch.int32, k // 16),
        (packed.scales, torch.int8, k // 16),
        (packed.d, torch.float16, k // 256),
    )
    for t, dtype, width in expected:
        if t.shape != (n, width) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(
                f"a packed Q6_K weight of {n} rows of {k} values holds contiguous {dtype} "
                f"[{n}, {width}]; got {t.dtype} {tuple(t.shape)} with strides {t.stride()}"
            )
    return n, k


def _launch(
    n: int, k: int, sms: int, launch: Launch | None = None
) -> tuple[tuple[int, int], tuple[int, ...], dict[str, int]]:
    """The one-row kernel's grid, integer arguments and compile-time arguments (those of
    :func:`~backplane.kernels.qgemv_packed._launch`, less its ``TWO``).

    :param n: output rows.
    :param k: values per row.
    :param sms: the device's multiprocessor count.
    :param launch: instead of :func:`plan`'s.
    :return: ``(grid, (N, rows_per_program, split_k), constexprs)``,
        ``constexprs`` holding ``num_warps`` too.
    :raises ValueError: a launch of one group a thread, or of a chunk that is not whole
        super-blocks (a thread takes a pair of groups of one super-block).
    """
    launch = plan(n, k, sms) if launch is None else launch
    if launch.groups_per_thread != 2 or launch.block_k % QK_K:
        raise ValueError(
            f"the packed Q6_K kernel takes two groups a thread and chunks of whole "
            f"{QK_K}-value super-blocks; got {launch}"
        )
    grid, ints, constexprs = qgemv_packed._launch(n, k, sms, launch)
    del constexprs["TWO"]
    return grid, ints, constexprs


def plan(n: int, k: int, sms: int) -> Launch:
    """The one-row kernel's launch for an ``[n, k]`` weight.

    The packed Q4_K kernel's plan (:func:`~backplane.kernels.qgemv_packed.plan`,
    the fastest launch measured there): chunks of 1024 inputs (fewer for a
    narrower row), a pair of groups a thread, 2 rows a tile walked by one warp,
    each row tile's loads issued an iteration ahead, about
    :data:`_PROGRAMS_PER_SM` programs per multiprocessor. Not measured for Q6_K
    yet (``benchmarks/qgemv_packed.py --sweep --shapes lm_head_q6k,down_q6k``).

    :param n: output rows.
    :param k: values per row (a multiple of 256).
    :param sms: the device's multiprocessor count.
    :return: the launch.
    """
    block_k = min(_BLOCK_K, 1 << (k - 1).bit_length())
    launch = Launch(_BLOCK_N, block_k, _WARPS, _BLOCK_N, 2, prefetch=_PREFETCH)
    while not launch.fills():
        launch = launch._replace(block_n=launch.block_n * 2)
    split_k = cdiv(k, block_k)
    row_runs = max(1, _PROGRAMS_PER_SM * sms // split_k)
    rows = cdiv(cdiv(n, row_runs), launch.block_n) * launch.block_n
    return launch._replace(rows_per_program=rows)


def dequantize_packed_matrix(packed: PackedQ6K, dtype: torch.dtype) -> torch.Tensor:
    """The matrix of ``packed`` in ``dtype``, in one kernel (the several-row products multiply
    it; it is not kept). Values are ggml's float32 ``(d * scale) * (q - 32)``, rounded to
    ``dtype``.

    :param packed: the weight ``[N, K]``.
    :param dtype: the matrix's dtype (one of :data:`DTYPES`).
    :return: ``[N, K]`` on the weight's device.
    :raises ValueError: a width or dtype :func:`supports` refuses.
    """
    n, k = _check(packed)
    if not supports(k, dtype):
        raise ValueError(f"the packed Q6_K kernels do not write rows of {k} values in {dtype}")
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    grid = (cdiv(n, _DQ_BLOCK_N), cdiv(k, _DQ_BLOCK_K))
    compile_ahead.launch(
        _dequant_packed_q6k_kernel,
        grid,
        packed.ql,
        packed.qh,
        packed.scales.view(torch.int32),
        packed.d,
        out,
        n,
        k,
        BLOCK_N=_DQ_BLOCK_N,
        BLOCK_K=_DQ_BLOCK_K,
    )
    return out
