"""A one-row product with a repacked Q4_K weight (:mod:`.q4k_layout`), for batch-1 decode.

At one input row a projection's time is the bytes of its weight over the
memory bandwidth, if the kernel's instructions keep up with the bytes: an
H200 issues about 0.22 warp-instructions per byte it streams, about 3.9
thread-instructions per Q4_K weight. Reading ggml's blocks (:mod:`.qgemv`)
takes 0.49 per byte of Q4_K; :func:`packed_gemv` reads the layout of
:class:`~backplane.kernels.q4k_layout.PackedQ4K` in 0.17 (three
instructions a weight, counted in its sm_90 SASS by
``benchmarks/qgemv_sass.py --packed``), keeping the parallelism of the
raw-block kernel:

- a program owns a chunk of ``BLOCK_K`` inputs and a run of output rows. It
  loads its chunk of ``x`` once, into float32 registers (each thread the
  values of its groups, in the order of its nibbles) with each group's sum,
  and walks its rows ``BLOCK_N`` at a time, loading each row tile an
  iteration ahead (:class:`Launch` ``prefetch``: with one load in flight per
  program, the loop waited a memory latency per tile). On Hopper it launches
  as a programmatic dependent: the first tile's loads are issued before it
  waits for the kernel before it;
- a thread reads a 32-value group of a row as one 16-byte load of four
  words. A float32 whose bit pattern is below 2**24 is worth ``pattern *
  2**-149``, so a nibble masked in place *is* the float ``q * 2**(bit -
  149)``: one ``LOP3`` a weight (and one shift per word for its top two
  nibbles), no conversion instruction, and one multiply-add with the input,
  which was scaled by the matching power of two when it was loaded
  (:func:`_nibble`, :func:`_resident_x`). Products are exact float32
  products scaled by ``2**-85``, sums float32;
- scales apply per group: ``sum((d*sc*q - dmin*m) * x) = d*sc * dot(q, x) -
  dmin*m * sum(x)``; with two groups per thread (:class:`Launch`) the
  cross-thread sum of a row comes every 64 values instead of 32;
- each row's chunk sum is a partial of a split-K product: it is stored, and
  the program that arrives last at its run of rows (an arrival counter per
  run, left at zero, see :mod:`.split_k`) adds the partials in split order,
  up to 2048 of them in loads issued together (one after another, one per row
  block and split, they were a third or more of the kernel's time). One
  launch, replayable in a CUDA graph, deterministic.

Inputs must be finite and below 2**64 in magnitude (the scaled copies
overflow beyond); products below about 2**-41 keep an absolute accuracy of
2**-64 instead of a relative one.

Several input rows expand the weight first: :func:`dequantize_packed_matrix`
writes it in the input's dtype, value by value with ggml's arithmetic, for
the caller to multiply (and drop).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from backplane.core import compile_ahead
from backplane.core.launch import cdiv, dependent_launch, next_pow2
from backplane.kernels.availability import interpreting
from backplane.kernels.q4k_layout import QK_K, PackedQ4K
from backplane.kernels.split_k import scratch as _scratch
from backplane.kernels.split_k import sum_parts

#: dtypes of the input (and output) the kernels take
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: default launch (see :func:`plan`): rows per iteration, inputs per program, warps,
#: groups per thread, row tiles loaded ahead, programs per multiprocessor
_BLOCK_N = 2
_BLOCK_K = 1024
_WARPS = 1
_GROUPS_PER_THREAD = 2
_PREFETCH = 1
_PROGRAMS_PER_SM = 16


class Launch(NamedTuple):
    """A launch of the one-row kernel (see :func:`plan`).

    :param block_n: rows a program multiplies per iteration (a power of two).
    :param block_k: inputs per program (a power of two, 32 or more; 64 or more with
        two groups per thread): the reduction is split ``K / block_k`` ways.
    :param num_warps: warps per program.
    :param rows_per_program: rows a program walks (rounded up to ``block_n``).
    :param groups_per_thread: 32-value groups a thread takes of each row, 1 or 2 (one in
        each half of the chunk): two halve the cross-thread sums per weight and double
        the inputs a thread keeps in registers.
    :param stages: 1, or 2 to have Triton prefetch the next row tile into shared memory
        while the current one is multiplied (``cp.async``: more bytes in flight, about
        13% more instructions and a barrier an iteration).
    :param prefetch: row tiles loaded ahead, into registers: 0, 1 or 2 (a program then
        always has that many tiles' loads in flight while it multiplies).
    """

    block_n: int
    block_k: int
    num_warps: int
    rows_per_program: int
    groups_per_thread: int = 1
    stages: int = 1
    prefetch: int = 0

    def fills(self) -> bool:
        """Whether each thread has a group of a row of its own (a row tile of fewer
        ``(row, group)`` pairs than threads would multiply some twice)."""
        lanes = self.block_k // (32 * self.groups_per_thread)
        return lanes >= 1 and self.block_n * lanes >= 32 * self.num_warps


#: rows and values per program of the dequantising kernel
_DQ_BLOCK_N = 16
_DQ_BLOCK_K = 256

#: per device: its multiprocessor count
_SMS: dict[torch.device, int] = {}


@triton.jit
def _f16_half(v, HIGH: tl.constexpr):
    """The float16 in the low (or high) half of int32 ``v``, as float32."""
    if HIGH:
        h = (v >> 16) & 0xFFFF
    else:
        h = v & 0xFFFF
    return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(words, S: tl.constexpr):
    """Nibble ``S`` of int32 ``words`` as the float32 ``q * 2**(B - 149)``, ``B`` the bit it
    starts at here (``4 * S``; ``4 * S - 8`` for ``S`` 6 and 7), exactly.

    A float32 bit pattern below 2**24 is worth ``pattern * 2**-149`` (the subnormals and
    the first exponent), so masking the nibble in place is the conversion: one ``LOP3``
    with one immediate, no shift and no int-to-float instruction (a quarter of the FMA
    rate). The top two nibbles are shifted down a byte first. FMA takes subnormal
    operands at full rate (Triton does not flush them to zero).
    """
    if S < 6:
        v = words & (0xF << (4 * S))
    else:
        v = (words >> 8) & (0xF << (4 * S - 8))
    return v.to(tl.float32, bitcast=True)


@triton.jit
def _group_x(x_ptr, k_g, w, g_ok, EVEN_K: tl.constexpr):
    """The inputs of groups ``k_g`` (first values) in the order of their nibbles: eight
    float32 ``[G, 4]``, the ``S``-th holding values ``k_g + 4 * S + w`` (zero where
    ``g_ok`` is false)."""
    xk = x_ptr + k_g[:, None] + w[None, :]
    if EVEN_K:
        x0 = tl.load(xk).to(tl.float32)
        x1 = tl.load(xk + 4).to(tl.float32)
        x2 = tl.load(xk + 8).to(tl.float32)
        x3 = tl.load(xk + 12).to(tl.float32)
        x4 = tl.load(xk + 16).to(tl.float32)
        x5 = tl.load(xk + 20).to(tl.float32)
        x6 = tl.load(xk + 24).to(tl.float32)
        x7 = tl.load(xk + 28).to(tl.float32)
    else:
        xm = g_ok[:, None]
        x0 = tl.load(xk, mask=xm, other=0.0).to(tl.float32)
        x1 = tl.load(xk + 4, mask=xm, other=0.0).to(tl.float32)
        x2 = tl.load(xk + 8, mask=xm, other=0.0).to(tl.float32)
        x3 = tl.load(xk + 12, mask=xm, other=0.0).to(tl.float32)
        x4 = tl.load(xk + 16, mask=xm, other=0.0).to(tl.float32)
        x5 = tl.load(xk + 20, mask=xm, other=0.0).to(tl.float32)
        x6 = tl.load(xk + 24, mask=xm, other=0.0).to(tl.float32)
        x7 = tl.load(xk + 28, mask=xm, other=0.0).to(tl.float32)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _resident_x(x_ptr, k_g, w, g_ok, EVEN_K: tl.constexpr):
    """The inputs of groups ``k_g`` (first values), each nibble position's four as
    float32 ``[G, 4]`` scaled by ``2**(149 - 85 - B)`` to meet :func:`_nibble`'s
    ``2**(B - 149)``, and each group's sum ``[1, G]`` scaled by ``2**-85`` to match.

    Products then come out as ``q * x * 2**-85``: normal floats, exact as float32
    products are, for ``|q * x|`` from about 2**-41 (smaller ones are kept to 2**-64),
    and finite for ``|x| < 2**64``.
    """
    x0, x1, x2, x3, x4, x5, x6, x7 = _group_x(x_ptr, k_g, w, g_ok, EVEN_K)
    xsum = tl.sum(((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), axis=1)[None, :]
    # 2**(64 - B) for B = 0, 4, 8, 12, 16, 20, 16, 20; 2**-85
    return (
        x0 * 18446744073709551616.0,
        x1 * 1152921504606846976.0,
        x2 * 72057594037927936.0,
        x3 * 4503599627370496.0,
        x4 * 281474976710656.0,
        x5 * 17592186044416.0,
        x6 * 281474976710656.0,
        x7 * 17592186044416.0,
        xsum * 2.5849394142282115e-26,
    )


@triton.jit
def _load(ptr, mask, EVEN: tl.constexpr):
    """``ptr``'s values, zero where ``mask`` is false (no mask at all when ``EVEN``)."""
    if EVEN:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0)


@triton.jit
def _split4(t):
    """The four slices of ``t``'s last axis (of 4, held by one thread), in the order
    0, 2, 1, 3 (the same for every tensor, so words and inputs pair up)."""
    a, b = tl.split(tl.reshape(t, t.shape[:-1] + [2, 2]))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, a1, b0, b1


@triton.jit
def _word_dot(w0, w1, w2, w3, xs, S: tl.constexpr, acc):
    """``acc`` plus nibble ``S`` of the four words times their four inputs ``xs [G, 4]``."""
    x0, x1, x2, x3 = _split4(xs)
    acc += _nibble(w0, S) * x0[None, :]
    acc += _nibble(w1, S) * x1[None, :]
    acc += _nibble(w2, S) * x2[None, :]
    acc += _nibble(w3, S) * x3[None, :]
    return acc


@triton.jit
def _group_tile(qs_at, sm_at, dm_at, m2, EVEN: tl.constexpr):
    """A row tile's groups: their words ``[BLOCK_N, G, 4]``, scale-and-min half-words
    and super-block ``d``/``dmin`` words ``[BLOCK_N, G]`` (zero where ``m2`` is false)."""
    words = _load(qs_at, m2[:, :, None], EVEN)
    sm = _load(sm_at, m2, EVEN)
    dm = _load(dm_at, m2, EVEN)
    return words, sm, dm


@triton.jit
def _row_tile(rows, offs, ahead, r_ok, a_ok, b_ok, K: tl.constexpr, BLOCK_N: tl.constexpr, TWO: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
    """The row tile ``ahead`` tiles after the one at the row pointers ``rows`` (quant
    words, scales, ``d``/``dmin``), at the offsets ``offs`` of the first half's and the
    second half's groups: both halves' :func:`_group_tile` (the second half is the
    first's tensors when not ``TWO``)."""
    qs_at = rows[0] + ahead * (BLOCK_N * (K // 8))
    sm_at = rows[1] + ahead * (BLOCK_N * (K // 32))
    dm_at = rows[2] + ahead * (BLOCK_N * (K // 256))
    wa, sa, da = _group_tile(qs_at + offs[0], sm_at + offs[1], dm_at + offs[2], r_ok & a_ok, EVEN)
    if TWO:
        wb, sb, db = _group_tile(
            qs_at + offs[3], sm_at + offs[4], dm_at + offs[5], r_ok & b_ok, EVEN
        )
    else:
        wb, sb, db = wa, sa, da
    return wa, sa, da, wb, sb, db


@triton.jit
def _group_part(words, sm, dm, x0, x1, x2, x3, x4, x5, x6, x7, xsum):
    """Each row's sum over each group of a tile (:func:`_group_tile`), ``[BLOCK_N, G]``,
    times ``2**-85``: ``d*sc * dot(q, x) - dmin*m * sum(x)``."""
    sm = sm.to(tl.int32)
    # one chain of multiply-adds over the group's 32 products (the four words are in-thread)
    w0, w1, w2, w3 = _split4(words)
    acc = _word_dot(w0, w1, w2, w3, x0, 0, 0.0)
    acc = _word_dot(w0, w1, w2, w3, x1, 1, acc)
    acc = _word_dot(w0, w1, w2, w3, x2, 2, acc)
    acc = _word_dot(w0, w1, w2, w3, x3, 3, acc)
    acc = _word_dot(w0, w1, w2, w3, x4, 4, acc)
    acc = _word_dot(w0, w1, w2, w3, x5, 5, acc)
    acc = _word_dot(w0, w1, w2, w3, x6, 6, acc)
    acc = _word_dot(w0, w1, w2, w3, x7, 7, acc)
    scale = _f16_half(dm, False) * (sm & 0xFF).to(tl.float32)
    offset = _f16_half(dm, True) * ((sm >> 8) & 0xFF).to(tl.float32)
    return scale * acc - offset * xsum


@triton.jit
def _store_tile(part, y_ptr, part_ptr, out_off, store, SPLITS: tl.constexpr):
    """Store a row tile's sums (``part``: ``[BLOCK_N, G]`` products scaled by ``2**-85``,
    see :func:`_resident_x`) from the lanes ``store`` marks: the output rows, or with
    ``SPLITS`` this split's float32 partials (``out_off``: where each row's goes)."""
    # undo the 2**-85 of the products
    total = tl.sum(part, axis=1)[:, None] * 38685626227668133590597632.0
    if SPLITS:
        tl.store(part_ptr + out_off, total, mask=store)
    else:
        tl.store(y_ptr + out_off, total.to(y_ptr.dtype.element_ty), mask=store)


@triton.jit
def _sum_splits(y_ptr, part_ptr, counter, row_start, row_end, split_k, SPLITS: tl.constexpr, TAIL_N: tl.constexpr):  # fmt: skip
    """Count this program in at ``counter`` (its run of rows); the last of the run's
    ``split_k`` programs to arrive adds their partials into the output rows, ``TAIL_N``
    rows at a time, and leaves the counter at zero for the next launch."""
    # Every thread's partial stores come before the (releasing) arrival.
    tl.debug_barrier()
    if tl.atomic_add(counter, 1, sem="acq_rel") == split_k - 1:
        # Whichever program arrives last adds the run's partials (a whole run at once
        # for the launches plan() makes).
        t = tl.arange(0, TAIL_N)
        for r0 in range(row_start, row_end, TAIL_N):
            rows = r0 + t
            ok = rows < row_end
            total = sum_parts(part_ptr, rows, ok, split_k, split_k, 1, SPLITS)
            tl.store(y_ptr + rows, total.to(y_ptr.dtype.element_ty), mask=ok)
        tl.atomic_xchg(counter, 0)


@triton.jit
def _packed_gemv_kernel(
    x_ptr,
    qs_ptr,
    sm_ptr,
    dm_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    N,
    rows_per_program,
    split_k,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TWO: tl.constexpr,
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
    # groups a thread takes of each row: one, or two (one in each half of the chunk)
    G: tl.constexpr = BLOCK_K // (64 if TWO else 32)
    g = tl.arange(0, G)
    w = tl.arange(0, 4)
    ka = pid_k * BLOCK_K + g * 32
    a_ok = ka < K
    if TWO:
        kb = ka + G * 32
        b_ok = kb < K
    row_start = pid_n * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, N)
    # int32 offsets within a row tile, int64 row tile bases moved BLOCK_N rows an iteration
    r = tl.arange(0, BLOCK_N)
    qs_off = r[:, None, None] * (K // 8) + ((ka // 8)[None, :, None] + w[None, None, :])
    sm_off = r[:, None] * (K // 32) + (ka // 32)[None, :]
    dm_off = r[:, None] * (K // 256) + (ka // 256)[None, :]
    if TWO:
        qs_off_b = qs_off + G * 4
        sm_off_b = sm_off + G
        dm_off_b = dm_off + (kb // 256 - ka // 256)[None, :]  # the second half's super-blocks
    qs_row = qs_ptr + row_start.to(tl.int64) * (K // 8)
    sm_row = sm_ptr + row_start.to(tl.int64) * (K // 32)
    dm_row = dm_ptr + row_start.to(tl.int64) * (K // 256)
    if not TWO:
        b_ok = a_ok
        qs_off_b, sm_off_b, dm_off_b = qs_off, sm_off, dm_off
    a_ok2 = a_ok[None, :]
    b_ok2 = b_ok[None, :]
    offs = (qs_off, sm_off, dm_off, qs_off_b, sm_off_b, dm_off_b)
    ptrs = (qs_row, sm_row, dm_row)
    if PREFETCH > 0:
        # The first PREFETCH row tiles; each iteration then loads the one PREFETCH
        # tiles ahead before multiplying its own, so a program always has that
        # many tiles' loads in flight.
        n1 = _row_tile(
            ptrs, offs, 0, (row_start + r < row_end)[:, None], a_ok2, b_ok2, K, BLOCK_N, TWO, False
        )
        if PREFETCH > 1:
            ok1 = (row_start + BLOCK_N + r < row_end)[:, None]
            n2 = _row_tile(ptrs, offs, 1, ok1, a_ok2, b_ok2, K, BLOCK_N, TWO, False)
    if PDL:
        # Everything below reads (or writes what may still be read by) the kernels
        # before; the weights are no kernel's output, so the first tiles' loads
        # overlap the previous kernel's tail.
        tl.extra.cuda.gdc_wait()
    # This program's inputs, kept for all its rows.
    xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7, xsa = _resident_x(x_ptr, ka, w, a_ok, EVEN_K)
    if TWO:
        xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7, xsb = _resident_x(x_ptr, kb, w, b_ok, EVEN_K)
    # Partial sums are stored row-major by row, split_k a row, from the first lane of each
    # row's threads: a store the reduction's layout makes (rows stored consecutively
    # would be laid out differently, through shared memory and a barrier every iteration).
    first = (g == 0)[None, :]
    if SPLITS:
        out_off = (row_start + r[:, None]) * split_k + pid_k + 0 * g[None, :]
    else:
        out_off = row_start + r[:, None] + 0 * g[None, :]
    for r0 in tl.range(row_start, row_end, BLOCK_N, num_stages=STAGES):
        r_ok = (r0 + r < row_end)[:, None]
        ptrs = (qs_row, sm_row, dm_row)
        if PREFETCH > 0:
            wa, sa, da, wb, sb, db = n1
            ahead_ok = (r0 + PREFETCH * BLOCK_N + r < row_end)[:, None]
            if PREFETCH > 1:
                n1 = n2
                n2 = _row_tile(ptrs, offs, 2, ahead_ok, a_ok2, b_ok2, K, BLOCK_N, TWO, False)
            else:
                n1 = _row_tile(ptrs, offs, 1, ahead_ok, a_ok2, b_ok2, K, BLOCK_N, TWO, False)
        else:
            wa, sa, da, wb, sb, db = _row_tile(
                ptrs, offs, 0, r_ok, a_ok2, b_ok2, K, BLOCK_N, TWO, EVEN
            )
        part = _group_part(wa, sa, da, xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7, xsa)
        if TWO:
            part += _group_part(wb, sb, db, xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7, xsb)
        store = first if EVEN_N else first & r_ok
        _store_tile(part, y_ptr, part_ptr, out_off, store, SPLITS)
        out_off += BLOCK_N * split_k if SPLITS else BLOCK_N
        qs_row += BLOCK_N * (K // 8)
        sm_row += BLOCK_N * (K // 32)
        dm_row += BLOCK_N * (K // 256)
    if SPLITS:
        _sum_splits(y_ptr, part_ptr, count_ptr + pid_n, row_start, row_end, split_k, SPLITS, TAIL_N)


@triton.jit
def _dequant_packed_kernel(
    qs_ptr,
    sm_ptr,
    dm_ptr,
    out_ptr,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    G: tl.constexpr = BLOCK_K // 32
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_g = tl.program_id(1) * BLOCK_K + tl.arange(0, G) * 32
    w = tl.arange(0, 4)
    m2 = (rows < N)[:, None] & (k_g < K)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    words = tl.load(
        qs_ptr + r64[:, :, None] * (K // 8) + ((k_g // 8)[None, :, None] + w[None, None, :]),
        mask=m2[:, :, None],
        other=0,
    )
    sm = tl.load(sm_ptr + r64 * (K // 32) + (k_g // 32)[None, :], mask=m2, other=0).to(tl.int32)
    dm = tl.load(dm_ptr + r64 * (K // 256) + (k_g // 256)[None, :], mask=m2, other=0)
    # ggml's arithmetic and rounding: (d * scale) * q - dmin * min
    scale = (_f16_half(dm, False) * (sm & 0xFF).to(tl.float32))[:, :, None]
    offset = (_f16_half(dm, True) * ((sm >> 8) & 0xFF).to(tl.float32))[:, :, None]
    out = out_ptr + r64[:, :, None] * K + (k_g[None, :, None] + w[None, None, :])
    m3 = m2[:, :, None]
    for s in tl.static_range(8):
        q = ((words >> (4 * s)) & 0xF).to(tl.float32)
        tl.store(out + 4 * s, (scale * q - offset).to(out_ptr.dtype.element_ty), mask=m3)


def supports(in_features: int, dtype: torch.dtype) -> bool:
    """Whether :func:`packed_gemv` runs rows of ``in_features`` values for an input of ``dtype``.

    :param in_features: values per weight row.
    :param dtype: the input's dtype.
    :return: whole Q4_K blocks per row and a dtype of :data:`DTYPES`.
    """
    return in_features % QK_K == 0 and in_features > 0 and dtype in DTYPES


def packed_gemv(
    x: torch.Tensor,
    packed: PackedQ4K,
    out: torch.Tensor | None = None,
    launch: Launch | None = None,
) -> torch.Tensor:
    """``x @ dequant(packed).T`` for one input row, dequantising in the kernel.

    :param x: ``[1, K]`` (or ``[K]``), on the weight's device, a dtype of :data:`DTYPES`.
    :param packed: the weight ``[N, K]`` (see :func:`~backplane.kernels.q4k_layout.repack_q4k`).
    :param out: where to write the row (``[1, N]``, contiguous, ``x``'s dtype and device);
        a new tensor when ``None``.
    :param launch: a :class:`Launch` instead of :func:`plan`'s (tuning).
    :return: ``[1, N]`` in ``x``'s dtype (``out`` when given).
    :raises ValueError: a width or dtype :func:`supports` refuses, tensors not laid out
        as :class:`~backplane.kernels.q4k_layout.PackedQ4K` says, an input that is not one
        row of ``K`` values, or an ``out`` that does not fit.
    """
    n, k = _check(packed)
    if not supports(k, x.dtype):
        raise ValueError(
            f"the packed Q4_K kernel does not run rows of {k} values in {x.dtype}; "
            "dequantise the weight instead"
        )
    xr, y = _row_and_output(x, k, n, out)
    grid, ints, constexprs = _launch(n, k, _sm_count(x.device), launch)
    if x.is_cuda and dependent_launch(
        x.device.index if x.device.index is not None else torch.cuda.current_device()
    ):
        constexprs.update(PDL=True, launch_pdl=True)
    split_k = grid[1]
    counters, part = _scratch(x.device, grid[0], split_k * n) if split_k > 1 else (y, y)
    compile_ahead.launch(
        _packed_gemv_kernel,
        grid,
        xr,
        packed.qs,
        packed.scales.view(torch.int16),
        packed.dm.view(torch.int32),
        y,
        part,
        counters,
        *ints,
        **constexprs,
    )
    return y


def _row_and_output(
    x: torch.Tensor, k: int, n: int, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-row kernels' input as a contiguous row of ``k`` values, and where they write
    their ``[1, n]`` output (``out``, or a new tensor); refuses what they cannot read or
    write (shared by the Q4_K and Q6_K kernels)."""
    xr = x.reshape(-1)
    if xr.numel() != k:
        raise ValueError(
            f"packed_gemv takes one input row of {k} values, got shape {tuple(x.shape)}; "
            "multiply several rows with dequantize_packed_matrix"
        )
    if out is None:
        return xr.contiguous(), torch.empty(1, n, dtype=x.dtype, device=x.device)
    if out.shape != (1, n) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out must be [1, {n}] {x.dtype} on {x.device}, got {tuple(out.shape)} "
            f"{out.dtype} on {out.device}"
        )
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    return xr.contiguous(), out


def _check(packed: PackedQ4K) -> tuple[int, int]:
    """Refuse tensors the kernels would misread (they assume contiguous rows); return
    ``(N, K)``."""
    n, k = packed.shape
    expected = (
        (packed.qs, torch.int32, k // 8),
        (packed.scales, torch.uint8, k // 16),
        (packed.dm, torch.float16, k // 128),
    )
    for t, dtype, width in expected:
        if t.shape != (n, width) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(
                f"a packed Q4_K weight of {n} rows of {k} values holds contiguous {dtype} "
                f"[{n}, {width}]; got {t.dtype} {tuple(t.shape)} with strides {t.stride()}"
            )
    return n, k


def _launch(
    n: int, k: int, sms: int, launch: Launch | None = None
) -> tuple[tuple[int, int], tuple[int, ...], dict[str, int]]:
    """The one-row kernel's grid, integer arguments and compile-time arguments.

    :param n: output rows.
    :param k: values per row.
    :param sms: the device's multiprocessor count.
    :param launch: instead of :func:`plan`'s.
    :return: ``(grid, (N, rows_per_program, split_k), constexprs)``,
        ``constexprs`` holding ``num_warps`` too.
    """
    launch = plan(n, k, sms) if launch is None else launch
    split_k = cdiv(k, launch.block_k)
    rows = cdiv(max(launch.rows_per_program, 1), launch.block_n) * launch.block_n
    splits = next_pow2(split_k) if split_k > 1 else 0
    constexprs = {
        "K": k,
        "BLOCK_N": launch.block_n,
        "BLOCK_K": launch.block_k,
        "TWO": launch.groups_per_thread == 2,
        "EVEN_N": n % launch.block_n == 0,
        "SPLITS": splits,
        # rows of partials the tail adds per load: about 2048 floats a load
        "TAIL_N": min(next_pow2(rows), max(launch.block_n, 2048 // max(splits, 1))),
        "STAGES": launch.stages,
        "PREFETCH": int(launch.prefetch),
        "PDL": False,
        "num_warps": launch.num_warps,
    }
    return (cdiv(n, rows), split_k), (n, rows, split_k), constexprs


def plan(n: int, k: int, sms: int) -> Launch:
    """The one-row kernel's launch for an ``[n, k]`` weight.

    Inputs are split into chunks of 1024, two 32-value groups a thread (the
    partial sums written are ``k / 1024`` floats a row, under 2% of the
    weight's bytes); rows are walked 2 at a time by one warp, each row tile's
    loads issued an iteration ahead, and each program takes as many rows as
    leave about :data:`_PROGRAMS_PER_SM` programs per multiprocessor. Small
    widths take a smaller chunk and more rows per iteration. This is the
    fastest launch of ``benchmarks/qgemv_packed.py --sweep`` at the
    Llama-3.1-8B projections on an H200, or within 3% of it (us per call; in
    brackets the previous plan, 8-row tiles of two warps without the prefetch,
    its partials already read together: q/k/v 8.7 (11.4), o 7.6 (9.2), gate/up
    26.0 (37.4), down 14.9 (26.3)).

    :param n: output rows.
    :param k: values per row.
    :param sms: the device's multiprocessor count.
    :return: the launch.
    """
    block_k = min(_BLOCK_K, 1 << (k - 1).bit_length())
    groups = _GROUPS_PER_THREAD if block_k >= 64 else 1
    launch = Launch(_BLOCK_N, block_k, _WARPS, _BLOCK_N, groups, prefetch=_PREFETCH)
    while not launch.fills():
        launch = launch._replace(block_n=launch.block_n * 2)
    split_k = cdiv(k, block_k)
    row_runs = max(1, _PROGRAMS_PER_SM * sms // split_k)
    rows = cdiv(cdiv(n, row_runs), launch.block_n) * launch.block_n
    return launch._replace(rows_per_program=rows)


def _sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (4 in the interpreter, to exercise the split path)."""
    if interpreting():
        return 4
    count = _SMS.get(device)
    if count is None:
        count = _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return count


def dequantize_packed_matrix(packed: PackedQ4K, dtype: torch.dtype) -> torch.Tensor:
    """The matrix of ``packed`` in ``dtype``, in one kernel (the several-row products multiply
    it; it is not kept). Values are ggml's float32 ``(d * scale) * q - dmin * min``, rounded
    to ``dtype``.

    :param packed: the weight ``[N, K]``.
    :param dtype: the matrix's dtype (one of :data:`DTYPES`).
    :return: ``[N, K]`` on the weight's device.
    :raises ValueError: a width or dtype :func:`supports` refuses.
    """
    n, k = _check(packed)
    if not supports(k, dtype):
        raise ValueError(f"the packed Q4_K kernels do not write rows of {k} values in {dtype}")
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    grid = (cdiv(n, _DQ_BLOCK_N), cdiv(k, _DQ_BLOCK_K))
    compile_ahead.launch(
        _dequant_packed_kernel,
        grid,
        packed.qs,
        packed.scales.view(torch.int16),
        packed.dm.view(torch.int32),
        out,
        n,
        k,
        BLOCK_N=_DQ_BLOCK_N,
        BLOCK_K=_DQ_BLOCK_K,
    )
    return out
