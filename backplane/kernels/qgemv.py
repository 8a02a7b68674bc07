"""A one-row product with a GGUF-quantised weight, dequantised in registers (batch-1 decode).

At one input row a projection's time is the bytes of its weight over the
memory bandwidth, so a weight kept as GGUF blocks (Q4_K: 4.5 bits a value)
is read in about a quarter of the time of its bfloat16 form, provided the
blocks are dequantised where they are read, cheaply enough that the
instructions keep up with the bytes. :func:`quantized_gemv` does that:

- each program owns ``BLOCK_N`` output rows and reads a few blocks of each
  per iteration as one tile of the contiguous quant bytes (one load per byte
  of weight data), pairing each byte's nibbles with the input values they
  multiply (Q4_K: byte ``c * 32 + l`` holds values ``c * 64 + l`` and
  ``c * 64 + 32 + l``);
- scales and mins apply per sub-block, not per value:
  ``sum((d*sc*q - dmin*mn) * x) = d*sc * dot(q, x) - dmin*mn * sum(x)``, so
  each weight costs a nibble extraction, an exact int-to-float through the
  float's mantissa and one multiply-add, and a block's scale bytes are
  decoded once per row;
- rows with long reductions split them across programs (:func:`plan`) so
  that every projection fills the device; the program that finishes a row
  block last adds the partial sums in split order (an arrival counter per
  row block, left at zero: one launch, replayable in a CUDA graph,
  deterministic results).

Sums are float32; output rows are written in the input's dtype.

For several input rows a GEMM is compute-bound enough that the blocks can be
expanded first: :func:`dequantize_blocks` writes the matrix in the input's
dtype, decoding each value on its own (``(d * scale) * q - dmin * min``, the
arithmetic order of the reference), in one kernel, for the caller to
multiply (and drop).

The byte layouts are ggml's (see :mod:`backplane.models.gguf.dequant`); the
tests hold both kernels to ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backplane.core import compile_ahead
from backplane.core.launch import cdiv
from backplane.kernels.availability import interpreting
from backplane.kernels.split_k import scratch as _scratch

#: ggml type ids the kernel reads -> (values per block, bytes per block)
LAYOUTS: dict[int, tuple[int, int]] = {
    8: (32, 34),  # Q8_0
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
}

#: dtypes of the input (and output) the kernel takes
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_TILE = 256  # values per step of the dequantising kernel: one k-quant block, eight Q8_0
_BLOCK_N = 16  # output rows per program of the dequantising kernel
_ROW_BLOCK_N = 8  # output rows per program of the one-row kernel

#: warps per program of the one-row kernel, per type (Q6_K: 4, the others 2; measured
#: with ``benchmarks/qgemv.py --sweep`` on an H200, see :func:`plan`)
_WARPS: dict[int, int] = {8: 2, 12: 2, 13: 2, 14: 4}

#: per type, the one-row kernel's blocks per iteration and the groups they form
#: (Q8_0: 32 values a group, Q4_K / Q5_K: 64, Q6_K: 2 x 16), 512 values a row
_STEPS: dict[int, tuple[int, int]] = {8: (16, 16), 12: (2, 8), 13: (2, 8), 14: (2, 16)}

#: per device: its multiprocessor count
_SMS: dict[torch.device, int] = {}


@triton.jit
def _f16_at(ptr, mask):
    """The little-endian float16 at ``ptr`` (two bytes), as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte_at(ptr, mask):
    """The byte at ``ptr`` as int32 (0..255)."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _k_scale_min(s_ptr, j, mask):
    """Sub-block ``j``'s 6-bit scale and min of a Q4_K / Q5_K block (12 bytes at ``s_ptr``)."""
    low = j < 4
    s_j = _byte_at(s_ptr + j, mask)
    s_j4 = _byte_at(s_ptr + j + 4, mask)
    s_jm4 = _byte_at(s_ptr + tl.where(low, j, j - 4), mask)
    sc = tl.where(low, s_j & 63, (s_j4 & 0xF) | ((s_jm4 >> 6) << 4))
    mn = tl.where(low, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _dequant_tile(base, i, mask, GGML_TYPE: tl.constexpr):
    """Float32 values at positions ``i`` of the blocks starting at ``base`` (``mask``: which load)."""
    if GGML_TYPE == 8:  # Q8_0: d, 32 int8
        d = _f16_at(base, mask)
        q = tl.load(base + 2 + i, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = q.to(tl.float32) * d
    elif GGML_TYPE == 12:  # Q4_K: d, dmin, 12 scale bytes, 128 nibble bytes
        j = i // 32
        d = _f16_at(base, mask)
        dmin = _f16_at(base + 2, mask)
        sc, mn = _k_scale_min(base + 4, j, mask)
        qb = _byte_at(base + 16 + (j // 2) * 32 + i % 32, mask)
        q = ((qb >> ((j % 2) * 4)) & 0xF).to(tl.float32)
        w = (d * sc) * q - dmin * mn
    elif GGML_TYPE == 13:  # Q5_K: d, dmin, 12 scale bytes, 32 high-bit bytes, 128 nibbles
        j = i // 32
        l = i % 32  # noqa: E741 - ggml's name for the position in a sub-block
        d = _f16_at(base, mask)
        dmin = _f16_at(base + 2, mask)
        sc, mn = _k_scale_min(base + 4, j, mask)
        qh = _byte_at(base + 16 + l, mask)
        qb = _byte_at(base + 48 + (j // 2) * 32 + l, mask)
        q = (((qb >> ((j % 2) * 4)) & 0xF) | (((qh >> j) & 1) << 4)).to(tl.float32)
        w = (d * sc) * q - dmin * mn
    else:  # Q6_K: 128 low-nibble bytes, 64 high-bit bytes, 16 int8 scales, d
        half = i // 128
        quarter = (i % 128) // 32
        l = i % 32  # noqa: E741
        ql = _byte_at(base + half * 64 + (quarter % 2) * 32 + l, mask)
        qh = _byte_at(base + 128 + half * 32 + l, mask)
        q = ((ql >> ((quarter // 2) * 4)) & 0xF) | (((qh >> (quarter * 2)) & 3) << 4)
        sc = tl.load(base + 192 + i // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        d = _f16_at(base + 208, mask)
        w = (d * sc.to(tl.float32)) * (q - 32).to(tl.float32)
    return w


@triton.jit
def _exact_f32(q, offset: tl.constexpr):
    """``q - offset`` as float32 for int32 ``q`` in ``0..2**23``, exactly.

    ``q`` ORed into the mantissa of 2**23 is the float ``2**23 + q``; one
    subtraction then gives the value with the offset taken off, where a
    conversion instruction would run at a quarter of the FMA rate and bound
    the kernel by instructions rather than by the weight's bytes.
    """
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def _k4_units(x_ptr, blk, m2, u, c, g_ok, Q5: tl.constexpr):
    """Q4_K / Q5_K: each row's sum over the groups of 64 values ``(u, c)`` of its blocks at ``blk``.

    Quant byte ``c * 32 + l`` holds value ``c * 64 + l`` of sub-block ``2c`` in its
    low nibble and value ``c * 64 + 32 + l`` of sub-block ``2c + 1`` in its high
    one (Q5_K adds bit ``j`` of high-bit byte ``l`` for sub-block ``j``). Scales
    and mins apply per sub-block: ``sum((d*sc*q - dmin*mn) * x) = d*sc*dot(q, x)
    - dmin*mn*sum(x)``.
    """
    l = tl.arange(0, 32)  # noqa: E741 - ggml's name for the position in a sub-block
    m3 = m2[:, :, None]
    xk = (u * 256 + c * 64)[:, None] + l[None, :]
    x_lo = tl.load(x_ptr + xk, mask=g_ok[:, None], other=0.0).to(tl.float32)
    x_hi = tl.load(x_ptr + xk + 32, mask=g_ok[:, None], other=0.0).to(tl.float32)
    if Q5:
        qs = blk[:, :, None] + 48 + (c * 32)[None, :, None] + l[None, None, :]
    else:
        qs = blk[:, :, None] + 16 + (c * 32)[None, :, None] + l[None, None, :]
    qb = tl.load(qs, mask=m3, other=0).to(tl.int32)
    q_lo = qb & 0xF
    q_hi = qb >> 4
    if Q5:
        qh = tl.load(blk[:, :, None] + 16 + l[None, None, :], mask=m3, other=0).to(tl.int32)
        shift = (2 * c)[None, :, None]
        q_lo |= ((qh >> shift) & 1) << 4
        q_hi |= ((qh >> (shift + 1)) & 1) << 4
    dot_lo = tl.sum(_exact_f32(q_lo, 0.0) * x_lo[None, :, :], axis=2)
    dot_hi = tl.sum(_exact_f32(q_hi, 0.0) * x_hi[None, :, :], axis=2)
    d = _f16_at(blk, m2)
    dmin = _f16_at(blk + 2, m2)
    sc_lo, mn_lo = _k_scale_min(blk + 4, (2 * c)[None, :], m2)
    sc_hi, mn_hi = _k_scale_min(blk + 4, (2 * c + 1)[None, :], m2)
    xs_lo = tl.sum(x_lo, axis=1)[None, :]
    xs_hi = tl.sum(x_hi, axis=1)[None, :]
    part = d * (sc_lo * dot_lo + sc_hi * dot_hi) - dmin * (mn_lo * xs_lo + mn_hi * xs_hi)
    return tl.sum(tl.where(m2, part, 0.0), axis=1)


@triton.jit
def _q6_units(x_ptr, blk, m2, u, r, g_ok):
    """Q6_K: each row's sum over the groups ``(u, r)`` of its blocks at ``blk``.

    Group ``r = (half, p, hh)`` holds the 16 low-nibble bytes ``half * 64 + p * 32 +
    hh * 16 + i`` (values ``half * 128 + p * 32 + hh * 16 + i``, two high bits at
    ``2p`` of byte ``i`` of the half's high bits) and their high nibbles (values
    64 further, high bits at ``2p + 4``); each 16 values share one int8 scale.
    """
    half = r // 4
    p = (r // 2) % 2
    hh = r % 2
    i = tl.arange(0, 16)
    m3 = m2[:, :, None]
    first = half * 128 + p * 32 + hh * 16
    xk = (u * 256 + first)[:, None] + i[None, :]
    x_lo = tl.load(x_ptr + xk, mask=g_ok[:, None], other=0.0).to(tl.float32)
    x_hi = tl.load(x_ptr + xk + 64, mask=g_ok[:, None], other=0.0).to(tl.float32)
    low = (half * 64 + p * 32 + hh * 16)[None, :, None] + i[None, None, :]
    ql = tl.load(blk[:, :, None] + low, mask=m3, other=0).to(tl.int32)
    high = (128 + half * 32 + hh * 16)[None, :, None] + i[None, None, :]
    qh = tl.load(blk[:, :, None] + high, mask=m3, other=0).to(tl.int32)
    shift = (2 * p)[None, :, None]
    q_lo = (ql & 0xF) | (((qh >> shift) & 3) << 4)
    q_hi = (ql >> 4) | (((qh >> (shift + 4)) & 3) << 4)
    dot_lo = tl.sum(_exact_f32(q_lo, 32.0) * x_lo[None, :, :], axis=2)
    dot_hi = tl.sum(_exact_f32(q_hi, 32.0) * x_hi[None, :, :], axis=2)
    s = (half * 8 + p * 2 + hh)[None, :]
    sc_lo = tl.load(blk + 192 + s, mask=m2, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    sc_hi = tl.load(blk + 196 + s, mask=m2, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    d = _f16_at(blk + 208, m2)
    part = d * (sc_lo * dot_lo + sc_hi * dot_hi)
    return tl.sum(tl.where(m2, part, 0.0), axis=1)


@triton.jit
def _q8_units(x_ptr, blk, m2, u, g_ok):
    """Q8_0: each row's sum over the 32-value blocks ``u`` at ``blk``: ``d * dot(q, x)``."""
    l = tl.arange(0, 32)  # noqa: E741
    x = tl.load(x_ptr + (u * 32)[:, None] + l[None, :], mask=g_ok[:, None], other=0.0)
    qb = tl.load(blk[:, :, None] + 2 + l[None, None, :], mask=m2[:, :, None], other=0)
    # int8 as an offset byte (q + 128), taken back off in the exact conversion
    q = _exact_f32(qb.to(tl.int32) ^ 0x80, 128.0)
    dot = tl.sum(q * x.to(tl.float32)[None, :, :], axis=2)
    part = _f16_at(blk, m2) * dot
    return tl.sum(tl.where(m2, part, 0.0), axis=1)


@triton.jit
def _qgemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    N,
    row_bytes,
    n_units,
    units_per_split,
    split_k,
    GGML_TYPE: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    UNITS: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_base = w_ptr + rows.to(tl.int64) * row_bytes
    u_start = pid_k * units_per_split
    u_end = tl.minimum(u_start + units_per_split, n_units)
    g = tl.arange(0, GROUPS)
    # groups per block: Q8_0 1 (32 values), Q4_K / Q5_K 4 (64), Q6_K 8 (2 x 16)
    per: tl.constexpr = GROUPS // UNITS
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for u0 in range(u_start, u_end, UNITS):
        u = u0 + g // per
        g_ok = u < u_end
        m2 = row_ok[:, None] & g_ok[None, :]
        blk = row_base[:, None] + (u * TYPE_SIZE)[None, :]
        if GGML_TYPE == 8:
            acc += _q8_units(x_ptr, blk, m2, u, g_ok)
        elif GGML_TYPE == 12:
            acc += _k4_units(x_ptr, blk, m2, u, g % per, g_ok, False)
        elif GGML_TYPE == 13:
            acc += _k4_units(x_ptr, blk, m2, u, g % per, g_ok, True)
        else:
            acc += _q6_units(x_ptr, blk, m2, u, g % per, g_ok)
    if not SPLIT:
        tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)
    else:
        tl.store(part_ptr + pid_k * N + rows, acc, mask=row_ok)
        # Every thread's partial stores come before the (releasing) arrival.
        tl.debug_barrier()
        counter = count_ptr + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == split_k - 1:
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            # In split order, whichever program arrives last: the same sums
            # every run. Loads bypass L1 (".cg"): other SMs wrote the partials.
            for s in range(0, split_k):
                total += tl.load(
                    part_ptr + s * N + rows, mask=row_ok, other=0.0, cache_modifier=".cg"
                )
            tl.store(y_ptr + rows, total.to(y_ptr.dtype.element_ty), mask=row_ok)
            tl.atomic_xchg(counter, 0)


@triton.jit
def _dequant_kernel(
    w_ptr,
    out_ptr,
    N,
    K,
    row_bytes,
    GGML_TYPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = (rows < N)[:, None] & (k < K)[None, :]
    base = w_ptr + rows.to(tl.int64)[:, None] * row_bytes + ((k // BLOCK_SIZE) * TYPE_SIZE)[None, :]
    w = _dequant_tile(base, (k % BLOCK_SIZE)[None, :], mask, GGML_TYPE)
    out = out_ptr + rows.to(tl.int64)[:, None] * K + k[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask)


def supports(ggml_type: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether :func:`quantized_gemv` runs rows of ``in_features`` values of ``ggml_type``
    for an input of ``dtype``.

    :param ggml_type: the weight's ggml type id.
    :param in_features: values per weight row.
    :param dtype: the input's dtype.
    :return: a type of :data:`LAYOUTS`, whole blocks per row and a dtype of :data:`DTYPES`.
    """
    layout = LAYOUTS.get(int(ggml_type))
    return layout is not None and in_features % layout[0] == 0 and dtype in DTYPES


def quantized_gemv(
    x: torch.Tensor,
    blocks: torch.Tensor,
    ggml_type: int,
    in_features: int,
    out: torch.Tensor | None = None,
    launch: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """``x @ dequant(blocks).T`` for one input row, dequantising in the kernel.

    :param x: ``[1, in_features]`` (or ``[in_features]``), on the blocks' device.
    :param blocks: the weight's raw GGUF blocks ``[out_features, row_bytes]`` ``uint8``,
        rows contiguous.
    :param ggml_type: their ggml type id (see :func:`supports`).
    :param in_features: values per weight row.
    :param out: where to write the row (``[1, out_features]``, contiguous, ``x``'s dtype
        and device); a new tensor when ``None``.
    :param launch: ``(block_n, split_k, num_warps)`` instead of :func:`plan`'s (tuning;
        ``block_n`` a power of two).
    :return: ``[1, out_features]`` in ``x``'s dtype (``out`` when given).
    :raises ValueError: a type, width or dtype :func:`supports` refuses, blocks
        whose row size does not match, an input that is not one row of
        ``in_features`` values, or an ``out`` that does not fit.
    """
    _check(blocks, ggml_type, in_features, x.dtype)
    n = blocks.shape[0]
    xr = x.reshape(-1).contiguous()
    if xr.numel() != in_features:
        raise ValueError(
            f"quantized_gemv takes one input row of {in_features} values, got shape "
            f"{tuple(x.shape)}; multiply several rows with dequantize_blocks"
        )
    if out is None:
        y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    elif out.shape != (1, n) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out must be [1, {n}] {x.dtype} on {x.device}, got {tuple(out.shape)} "
            f"{out.dtype} on {out.device}"
        )
    elif not out.is_contiguous():
        raise ValueError("out must be contiguous")
    else:
        y = out
    grid, ints, constexprs = _launch(
        n, in_features, ggml_type, _sm_count(x.device), launch, blocks.stride(0)
    )
    split_k = grid[1]
    counters, part = _scratch(x.device, grid[0], split_k * n) if split_k > 1 else (y, y)
    compile_ahead.launch(_qgemv_kernel, grid, xr, blocks, y, part, counters, *ints, **constexprs)
    return y


def _launch(
    n: int,
    in_features: int,
    ggml_type: int,
    sms: int,
    launch: tuple[int, int, int] | None = None,
    row_stride: int | None = None,
) -> tuple[tuple[int, int], tuple[int, ...], dict[str, int]]:
    """The one-row kernel's grid, integer arguments and compile-time arguments.

    Shared by :func:`quantized_gemv` and ``benchmarks/qgemv_sass.py`` (which
    compiles the kernel without a device at the launches this picks).

    :param n: output rows.
    :param in_features: values per row.
    :param ggml_type: the blocks' ggml type id.
    :param sms: the device's multiprocessor count.
    :param launch: ``(block_n, split_k, num_warps)`` instead of :func:`plan`'s.
    :param row_stride: bytes from one row of blocks to the next (default: the row's bytes).
    :return: ``(grid, (N, row_bytes, n_units, units_per_split, split_k), constexprs)``,
        ``constexprs`` holding ``num_warps`` too.
    """
    block_size, type_size = LAYOUTS[int(ggml_type)]
    units = in_features // block_size
    step, groups = _STEPS[int(ggml_type)]
    if launch is None:
        block_n, split_k = plan(n, units, step, sms)
        num_warps = _WARPS[int(ggml_type)]
    else:
        block_n, split_k, num_warps = launch
    per_split = cdiv(cdiv(units, split_k), step) * step
    split_k = cdiv(units, per_split)
    constexprs = {
        "GGML_TYPE": int(ggml_type),
        "TYPE_SIZE": type_size,
        "UNITS": step,
        "GROUPS": groups,
        "BLOCK_N": block_n,
        "SPLIT": split_k > 1,
        "num_warps": num_warps,
    }
    row_stride = units * type_size if row_stride is None else row_stride
    ints = (n, row_stride, units, per_split, split_k)
    return (cdiv(n, block_n), split_k), ints, constexprs


def plan(n: int, units: int, step: int, sms: int) -> tuple[int, int]:
    """The one-row kernel's launch for ``n`` rows of ``units`` blocks each.

    Each program reads ``step`` blocks of ``BLOCK_N`` rows per iteration. The
    kernel is bound by its dequantising instructions more than by the bytes,
    so it wants many small programs: rows in blocks of 8, the reduction split
    until about fifteen programs per multiprocessor run, keeping at least two
    steps per split, with :data:`_WARPS` warps. Measured on an H200 at the
    Llama-3.1-8B projections (``benchmarks/qgemv.py --sweep``), against rows in
    blocks of 16, four warps and about four programs per multiprocessor: Q4_K
    q/k/v 21.5 -> 17.2 us, o 14.5 -> 12.7, gate/up 80.2 -> 59.1, down 42.5 ->
    34.1; Q6_K LM head 400 -> 363; Q8_0 and Q5_K alike.

    :param n: output rows.
    :param units: blocks per row.
    :param step: blocks per iteration (see :data:`_STEPS`).
    :param sms: the device's multiprocessor count.
    :return: ``(block_n, split_k)``, ``split_k`` a power of two.
    """
    block_n = _ROW_BLOCK_N
    row_blocks = cdiv(n, block_n)
    split_k = 1
    while row_blocks * split_k < 15 * sms and units // (split_k * 2) >= 2 * step:
        split_k *= 2
    return block_n, split_k


def _sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (4 in the interpreter, to exercise the split path)."""
    if interpreting():
        return 4
    count = _SMS.get(device)
    if count is None:
        count = _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return count


def dequantize_blocks(
    blocks: torch.Tensor, ggml_type: int, in_features: int, dtype: torch.dtype
) -> torch.Tensor:
    """Dequantise raw GGUF blocks into a new matrix of ``dtype`` in one kernel (the
    several-row products multiply it; it is not kept).

    :param blocks: ``[out_features, row_bytes]`` ``uint8``, rows contiguous.
    :param ggml_type: their ggml type id (see :func:`supports`).
    :param in_features: values per row.
    :param dtype: the matrix's dtype (one of :data:`DTYPES`).
    :return: ``[out_features, in_features]`` on the blocks' device.
    :raises ValueError: as :func:`quantized_gemv`.
    """
    _check(blocks, ggml_type, in_features, dtype)
    n = blocks.shape[0]
    out = torch.empty(n, in_features, dtype=dtype, device=blocks.device)
    grid = (cdiv(n, _BLOCK_N), cdiv(in_features, _TILE))
    compile_ahead.launch(
        _dequant_kernel,
        grid,
        blocks,
        out,
        n,
        in_features,
        blocks.stride(0),
        **_constants(ggml_type),
    )
    return out


def _constants(ggml_type: int) -> dict[str, int]:
    """The compile-time arguments both kernels take for blocks of ``ggml_type``.

    :param ggml_type: the blocks' ggml type id (one :func:`supports` accepts).
    :return: the type, its block size and bytes, and the tile sizes, by parameter name.
    """
    block_size, type_size = LAYOUTS[int(ggml_type)]
    return {
        "GGML_TYPE": int(ggml_type),
        "BLOCK_SIZE": block_size,
        "TYPE_SIZE": type_size,
        "TILE": _TILE,
        "BLOCK_N": _BLOCK_N,
    }


def _check(blocks: torch.Tensor, ggml_type: int, in_features: int, dtype: torch.dtype) -> int:
    """Refuse what the kernels do not run; return the bytes per row."""
    if not supports(ggml_type, in_features, dtype):
        raise ValueError(
            f"the GGUF kernels do not run ggml type {ggml_type} rows of {in_features} values "
            f"in {dtype}; dequantise the weight in torch instead"
        )
    block_size, type_size = LAYOUTS[int(ggml_type)]
    row_bytes = in_features // block_size * type_size
    if blocks.dim() != 2 or blocks.shape[1] != row_bytes or blocks.stride(-1) != 1:
        raise ValueError(
            f"blocks of shape {tuple(blocks.shape)} are not rows of {row_bytes} bytes "
            f"({in_features} values of ggml type {ggml_type})"
        )
    return row_bytes
