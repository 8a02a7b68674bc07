"""A one-row product with a GGUF-quantised weight, dequantised in registers (batch-1 decode).

At one input row a projection's time is the bytes of its weight over the
memory bandwidth, so a weight kept as GGUF blocks (Q4_K: 4.5 bits a value)
is read in about a quarter of the time of its bfloat16 form, provided the
blocks are dequantised where they are read, cheaply enough that the
instructions keep up with the bytes. :func:`quantized_gemv` does that:

The budget is tight: an H200 streams about 4.8 TB/s and issues about 1e12
warp-instructions a second, so a kernel keeps up only below about 0.2
warp-instructions per weight byte, some 7 per 32 bytes (Q4_K: 57 values).
``benchmarks/qgemv_sass.py`` counts the main loop's instructions from the
SASS. What keeps the count down, and why:

- every weight value costs three instructions and no more: one LOP3 takes its
  field out of a 32-bit word and ORs it into the mantissa of 2**23 (``magic``:
  the float ``2**23 + field * 2**shift`` for a field ending below bit 23, so
  fields are masked where they lie, not shifted down first), one multiply-add
  takes the ``2**23`` off and the ``2**shift`` out (exact, both powers of
  two), one multiply-add into the dot product. An int-to-float conversion
  runs at a quarter of that rate. ``magic`` is kept opaque to the compiler
  so that it sits in a register and the masks ride in the LOP3s as
  immediates; Q5_K's fifth bits and Q6_K's top two are merged into the
  nibbles' word first, a whole word with one three-input LOP3;
- weights are read as words with vector loads (Q4_K, Q5_K: 144- and 176-byte
  blocks keep 8-byte alignment, so 8-byte loads; Q8_0, Q6_K: 34- and 210-byte
  blocks only 2-byte: 16-bit loads), and the 16-bit inputs as 32- or 64-bit
  words that match the quant words element for element, so that the input
  tile and the weight tile get the same register layout: no layout
  conversion (a round trip through shared memory and a barrier) anywhere in
  the loop, and no reduction across lanes inside it: each thread keeps its
  partial sums in registers and they are reduced once, after the loop;
- each thread holds several rows at the same positions (a program is one
  warp of ``BLOCK_N`` rows, :data:`_ROW_BLOCK_N`, spread over
  :data:`_STEPS` blocks), so each input value it loads and converts serves
  all of them, and each thread holds whole sub-blocks of each row, so
  scales and mins apply per sub-block, not per value: ``sum((d*sc*q -
  dmin*mn) * x) = d*sc * dot(q, x) - dmin*mn * sum(x)``, ``sum(x)`` shared
  by the thread's rows;
- loads are not masked: rows past the end read the last row and blocks past
  a split's end its last block, and their sums are dropped; the first step
  runs before the loop, so that the accumulator takes the loads' layout.

Rows with long reductions split them across programs (:func:`plan`) so that
every projection fills the device; the program that finishes a row block
last adds the partial sums in split order (an arrival counter per row block,
left at zero: one launch, replayable in a CUDA graph, deterministic results).

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
#: output rows per program of the one-row kernel, per type: each thread holds 8
#: (Q8_0: 16 blocks over 16 lanes x 2), 8 (Q4_K / Q5_K: 8 blocks x 4 chunks of 64
#: values over 32 lanes) or 4 (Q6_K: 8 blocks over 8 lanes x 4) rows at its positions
_ROW_BLOCK_N: dict[int, int] = {8: 16, 12: 8, 13: 8, 14: 16}

#: warps per program of the one-row kernel, per type: one, so that the lanes span
#: blocks and the rows stay in registers (chosen by instructions per weight byte,
#: ``benchmarks/qgemv_sass.py``; ``benchmarks/qgemv.py --sweep`` times the others).
#: More warps, or fewer than 8 Q4_K / Q5_K blocks a step, spread lanes over a
#: thread's words and bring shuffles and layout conversions back into the loop.
_WARPS: dict[int, int] = {8: 1, 12: 1, 13: 1, 14: 1}

#: per type, the one-row kernel's blocks per iteration (its ``UNITS``)
_STEPS: dict[int, int] = {8: 16, 12: 8, 13: 8, 14: 8}

#: per type, the alignment in bytes the one-row kernel's word loads need of the blocks
#: (rows are whole blocks: 144 and 176 bytes are multiples of 16, 34 and 210 of 2)
_ALIGN: dict[int, int] = {8: 2, 12: 8, 13: 8, 14: 2}

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
def _field(word, mask: tl.constexpr, shift: tl.constexpr, magic):
    """The unsigned bit field ``(word & mask) >> shift`` as float32, exactly, in two instructions.

    ``(word & mask) | magic`` (``magic`` the bits of ``2**23``, the field ending
    below bit 23) is the float ``2**23 + field * 2**shift``; one multiply-add
    takes the ``2**23`` off and the ``2**shift`` out, both exact.
    """
    f = ((word & mask) | magic).to(tl.float32, bitcast=True)
    return f * (2.0**-shift) - 2.0 ** (23 - shift)


@triton.jit
def _k_scales(s1, s2, s3, c, magic):
    """Chunk ``c``'s two scales and two mins (sub-blocks ``2c`` and ``2c + 1``), as float32,
    from a Q4_K / Q5_K block's scale words ``s1 s2 s3`` (its bytes 4..15, little-endian).

    The eight 6-bit scales (and mins) are assembled four to a word, one byte
    each, then the chunk's pair is shifted down to bytes 0 and 1.
    """
    low = c < 2
    sc = tl.where(low, s1 & 0x3F3F3F3F, (s3 & 0x0F0F0F0F) | ((s1 >> 2) & 0x30303030))
    mn = tl.where(low, s2 & 0x3F3F3F3F, ((s3 >> 4) & 0x0F0F0F0F) | ((s2 >> 2) & 0x30303030))
    sh = (c % 2) * 16
    sc = sc >> sh
    mn = mn >> sh
    sc_lo = _field(sc, 0x3F, 0, magic)
    sc_hi = _field(sc, 0x3F00, 8, magic)
    mn_lo = _field(mn, 0x3F, 0, magic)
    mn_hi = _field(mn, 0x3F00, 8, magic)
    return sc_lo, sc_hi, mn_lo, mn_hi


@triton.jit
def _x_quad(xq, k: tl.constexpr):
    """Input ``k`` of the four 16-bit floats in each 64-bit word ``xq``, as float32."""
    if k % 2 == 0:
        bits = (xq >> (16 * k)).to(tl.int32) << 16
    else:
        bits = (xq >> (16 * k - 16)).to(tl.int32) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _x4(x_ptr, at):
    """The four inputs from ``4 * at`` on (``at``: a tile of indices), as float32 tiles.

    16-bit inputs are read as one 64-bit word per element, so that the tile of
    words matches the tile of quant words it multiplies element for element
    (same shape, same contiguity, hence the same layout: no conversion).
    """
    if x_ptr.dtype.element_ty == tl.float32:
        x0 = tl.load(x_ptr + 4 * at)
        x1 = tl.load(x_ptr + 4 * at + 1)
        x2 = tl.load(x_ptr + 4 * at + 2)
        x3 = tl.load(x_ptr + 4 * at + 3)
    elif x_ptr.dtype.element_ty == tl.bfloat16:
        xq = tl.load(x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + at)
        x0 = _x_quad(xq, 0)
        x1 = _x_quad(xq, 1)
        x2 = _x_quad(xq, 2)
        x3 = _x_quad(xq, 3)
    else:
        xq = tl.load(x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + at)
        x0 = (xq & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        x1 = ((xq >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        x2 = ((xq >> 32) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        x3 = ((xq >> 48) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return x0, x1, x2, x3


@triton.jit
def _pick(t, v, k: tl.constexpr):
    """Element ``k`` of the last axis of ``t`` (held by one thread), keeping that axis as 1."""
    return tl.sum(tl.where(v == k, t, 0), axis=3, keep_dims=True)


@triton.jit
def _k_blocks(x_ptr, blk, u, ok, magic, Q5: tl.constexpr):
    """Q4_K / Q5_K: ``[rows, units, chunk, 1]`` sums of the blocks at ``blk`` (``ok``:
    which count) times their inputs."""
    c = tl.arange(0, 4)[None, None, :, None]
    v = tl.arange(0, 2)[None, None, None, :]
    head = tl.load(blk.to(tl.pointer_type(tl.int64))[:, :, None, None] + v + 0 * c)
    h0 = _pick(head, v, 0)
    h1 = _pick(head, v, 1)
    w0 = h0.to(tl.int32)
    s1 = (h0 >> 32).to(tl.int32)
    s2 = h1.to(tl.int32)
    s3 = (h1 >> 32).to(tl.int32)
    d = (w0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((w0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    words = blk.to(tl.pointer_type(tl.int32))[:, :, None, None]
    qs = words + (12 if Q5 else 4) + c * 8 + v
    xat = (u * 64)[None, :, None, None] + c * 16 + v
    for k in tl.static_range(4):
        w = tl.load(qs + 2 * k)
        x0, x1, x2, x3 = _x4(x_ptr, xat + 2 * k)
        y0, y1, y2, y3 = _x4(x_ptr, xat + 2 * k + 8)
        if Q5:
            # The fifth bits: bit 2c (low nibbles) and 2c + 1 (high) of each high-bit
            # byte, merged in just above each nibble (one three-input LOP3 a word):
            # low values at bits 0-4, 8-12, 16-20, 24-28, high values likewise.
            qh = tl.load(qs + (2 * k - 8 - c * 8)) >> (2 * c)
            q4 = qh << 4
            q3 = qh << 3
            lw = ((w ^ q4) & 0x0F0F0F0F) ^ q4
            hw = (((w >> 4) ^ q3) & 0x0F0F0F0F) ^ q3
            a0 = _field(lw, 0x1F, 0, magic)
            a1 = _field(lw, 0x1F00, 8, magic)
            a2 = _field(lw, 0x1F0000, 16, magic)
            a3 = _field(lw >> 16, 0x1F00, 8, magic)
            b0 = _field(hw, 0x1F, 0, magic)
            b1 = _field(hw, 0x1F00, 8, magic)
            b2 = _field(hw, 0x1F0000, 16, magic)
            b3 = _field(hw >> 16, 0x1F00, 8, magic)
        else:
            # Nibbles taken where they lie (the top three from the word shifted
            # down by 16, so that each field ends below bit 23).
            w2 = w >> 16
            a0 = _field(w, 0xF, 0, magic)
            a1 = _field(w, 0xF00, 8, magic)
            a2 = _field(w, 0xF0000, 16, magic)
            a3 = _field(w2, 0xF00, 8, magic)
            b0 = _field(w, 0xF0, 4, magic)
            b1 = _field(w, 0xF000, 12, magic)
            b2 = _field(w2, 0xF0, 4, magic)
            b3 = _field(w2, 0xF000, 12, magic)
        if k == 0:
            p_lo = a0 * x0
            p_hi = b0 * y0
            sx_lo = (x0 + x1) + (x2 + x3)
            sx_hi = (y0 + y1) + (y2 + y3)
        else:
            p_lo += a0 * x0
            p_hi += b0 * y0
            sx_lo += (x0 + x1) + (x2 + x3)
            sx_hi += (y0 + y1) + (y2 + y3)
        p_lo += a1 * x1
        p_lo += a2 * x2
        p_lo += a3 * x3
        p_hi += b1 * y1
        p_hi += b2 * y2
        p_hi += b3 * y3
    sc_lo, sc_hi, mn_lo, mn_hi = _k_scales(s1, s2, s3, c, magic)
    dot_lo = tl.sum(p_lo, axis=3, keep_dims=True)
    dot_hi = tl.sum(p_hi, axis=3, keep_dims=True)
    xs_lo = tl.sum(sx_lo, axis=3, keep_dims=True)
    xs_hi = tl.sum(sx_hi, axis=3, keep_dims=True)
    part = d * (sc_lo * dot_lo + sc_hi * dot_hi) - dmin * (mn_lo * xs_lo + mn_hi * xs_hi)
    return tl.where(ok[None, :, None, None], part, 0.0)


@triton.jit
def _x2(x_ptr, at):
    """Inputs ``2 * at`` and ``2 * at + 1`` (``at``: a tile of indices), as float32 tiles;
    16-bit inputs read as one 32-bit word per element."""
    if x_ptr.dtype.element_ty == tl.float32:
        x0 = tl.load(x_ptr + 2 * at)
        x1 = tl.load(x_ptr + 2 * at + 1)
    else:
        xw = tl.load(x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + at)
        if x_ptr.dtype.element_ty == tl.bfloat16:
            x0 = (xw << 16).to(tl.float32, bitcast=True)
            x1 = (xw & -65536).to(tl.float32, bitcast=True)
        else:
            x0 = (xw & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x1 = (xw >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return x0, x1


@triton.jit
def _byte_field(word, hi: tl.constexpr, flip):
    """Signed byte ``hi`` (0 or 1) of the 16-bit ``word`` as float32, exactly: the byte
    offset by 128 (its sign bit flipped) in a magic float, then the offset taken off.

    ``flip`` is 2**23's bits with the byte's sign bit set (``0x4B000080`` or
    ``0x4B008000``): one XOR flips the sign and sets the exponent.
    """
    f = ((word & (0xFF00 if hi else 0xFF)) ^ flip).to(tl.float32, bitcast=True)
    if hi:
        return f * (2.0**-8) - (2.0**15 + 128.0)
    else:
        return f - (2.0**23 + 128.0)


@triton.jit
def _q8_blocks(x_ptr, blk, u, ok, flip0, flip1):
    """Q8_0: ``[rows, units]`` sums ``d * dot(q, x)`` of the blocks at ``blk``.

    Blocks are 34 bytes, so only 16-bit loads are aligned: each thread reads
    its blocks' 16 words one by one (all its rows' at once) and keeps their
    products in one chain per row and block.
    """
    words = blk.to(tl.pointer_type(tl.uint16))
    d = tl.load(words).to(tl.float16, bitcast=True).to(tl.float32)
    for k in tl.static_range(16):
        w = tl.load(words + 1 + k).to(tl.int32)
        x0, x1 = _x2(x_ptr, u * 16 + k)
        if k == 0:
            dot = _byte_field(w, 0, flip0) * x0
        else:
            dot += _byte_field(w, 0, flip0) * x0
        dot += _byte_field(w, 1, flip1) * x1
    return tl.where(ok, d * dot, 0.0)


@triton.jit
def _q6_field(word, mask: tl.constexpr, shift: tl.constexpr, magic):
    """A Q6_K value: the six bits ``(word & mask) >> shift``, less 32, as float32, exactly."""
    f = ((word & mask) | magic).to(tl.float32, bitcast=True)
    return f * (2.0**-shift) - (2.0 ** (23 - shift) + 32.0)


@triton.jit
def _q6_blocks(x_ptr, blk, u, ok, magic, flip0, flip1):
    """Q6_K: ``[rows, units]`` sums ``d * sum_g sc_g * dot_g(q - 32, x)`` of the blocks at
    ``blk``, ``g`` the sixteen groups of 16 values of one int8 scale each.

    ggml's layout, per half ``n`` of the block and position ``l < 32``: low
    nibbles of byte ``l`` of ``ql`` (``n * 64 + l``) are value ``l``, of byte
    ``32 + l`` value ``32 + l``, their high nibbles values ``64 + l`` and ``96 +
    l``; ``qh`` byte ``l`` (``128 + n * 32 + l``) holds the two top bits of those
    four at bits 0, 2, 4 and 6. Blocks are 210 bytes, so words are 16-bit: two
    positions ``l`` each.
    """
    words = blk.to(tl.pointer_type(tl.uint16))
    d = tl.load(words + 104).to(tl.float16, bitcast=True).to(tl.float32)
    acc = tl.zeros(blk.shape, dtype=tl.float32)
    # a loop, not unrolled: the four (half, group) passes of eight words each
    for ng in range(4):
        n = ng // 2
        g = ng % 2
        ws = words + n * 32 + g * 8
        at = u * 128 + n * 64 + g * 8
        for j in tl.static_range(8):
            a = tl.load(ws + j).to(tl.int32)
            b = tl.load(ws + 16 + j).to(tl.int32)
            h = tl.load(ws + (64 - n * 16) + j).to(tl.int32)
            # the four values' six bits, two positions a word: bits 0-5 and 8-13
            # (values 0 and 32 on), 4-9 and 12-17 (64 and 96 on): the nibbles
            # from ``a`` or ``b``, every other bit from the shifted high bits (one
            # three-input LOP3 each); the fields' masks drop what is not theirs
            h4 = h << 4
            h2 = h << 2
            q1 = ((a ^ h4) & 0x0F0F) ^ h4
            q2 = ((b ^ h2) & 0x0F0F) ^ h2
            q3 = ((a ^ h4) & 0xF0F0) ^ h4
            q4 = ((b ^ h2) & 0xF0F0) ^ h2
            x0, x1 = _x2(x_ptr, at + j)
            y0, y1 = _x2(x_ptr, at + j + 16)
            z0, z1 = _x2(x_ptr, at + j + 32)
            v0, v1 = _x2(x_ptr, at + j + 48)
            if j == 0:
                d1 = _q6_field(q1, 0x3F, 0, magic) * x0
                d2 = _q6_field(q2, 0x3F, 0, magic) * y0
                d3 = _q6_field(q3, 0x3F0, 4, magic) * z0
                d4 = _q6_field(q4, 0x3F0, 4, magic) * v0
            else:
                d1 += _q6_field(q1, 0x3F, 0, magic) * x0
                d2 += _q6_field(q2, 0x3F, 0, magic) * y0
                d3 += _q6_field(q3, 0x3F0, 4, magic) * z0
                d4 += _q6_field(q4, 0x3F0, 4, magic) * v0
            d1 += _q6_field(q1, 0x3F00, 8, magic) * x1
            d2 += _q6_field(q2, 0x3F00, 8, magic) * y1
            d3 += _q6_field(q3, 0x3F000, 12, magic) * z1
            d4 += _q6_field(q4, 0x3F000, 12, magic) * v1
        # the four dots' scales, bytes n * 8 + 2 * i + g: byte g of words 96 + n * 4 + i
        sw = words + 96 + n * 4
        sh = 8 * g
        acc += _byte_field(tl.load(sw).to(tl.int32) >> sh, 0, flip0) * d1
        acc += _byte_field(tl.load(sw + 1).to(tl.int32) >> sh, 0, flip0) * d2
        acc += _byte_field(tl.load(sw + 2).to(tl.int32) >> sh, 0, flip0) * d3
        acc += _byte_field(tl.load(sw + 3).to(tl.int32) >> sh, 0, flip0) * d4
    return tl.where(ok, d * acc, 0.0)


@triton.jit
def _step(
    x_ptr,
    rows,
    row_base,
    u0,
    u_end,
    GGML_TYPE: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    UNITS: tl.constexpr,
):
    """One iteration: units ``u0 .. u0 + UNITS`` of the program's rows, those past the
    split's end read as its last unit and left out of the sums."""
    u = u0 + tl.arange(0, UNITS)
    uc = tl.minimum(u, u_end - 1)
    blk = row_base[:, None] + (uc * TYPE_SIZE)[None, :]
    ok = u < u_end
    # ``magic`` is 2**23's bits, kept opaque (``u_end >= 0``) so that it sits in a
    # register and the field masks ride in the instructions as immediates (one
    # LOP3 a field), likewise the constants that also flip a byte's sign bit.
    opaque = u_end >> 31
    magic = 0x4B000000 + opaque
    flip0 = 0x4B000080 + opaque
    flip1 = 0x4B008000 + opaque
    if GGML_TYPE == 8:
        u2 = uc[None, :] + 0 * rows[:, None]
        return _q8_blocks(x_ptr, blk, u2, ok[None, :], flip0, flip1)
    elif GGML_TYPE == 14:
        u2 = uc[None, :] + 0 * rows[:, None]
        return _q6_blocks(x_ptr, blk, u2, ok[None, :], magic, flip0, flip1)
    else:
        return _k_blocks(x_ptr, blk, uc, ok, magic, GGML_TYPE == 13)


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
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    u_start = pid_k * units_per_split
    u_end = tl.minimum(u_start + units_per_split, n_units)
    # Rows past the end read the last row and units past the split's end its last
    # unit: valid bytes, so the loop loads without masks; their sums are dropped.
    row_base = w_ptr + tl.minimum(rows, N - 1).to(tl.int64) * row_bytes
    # The first step outside the loop: its sums give the accumulator the layout
    # of the loads, so the loop converts none.
    acc_t = _step(x_ptr, rows, row_base, u_start, u_end, GGML_TYPE, TYPE_SIZE, UNITS)
    for u0 in range(u_start + UNITS, u_end, UNITS):
        acc_t += _step(x_ptr, rows, row_base, u0, u_end, GGML_TYPE, TYPE_SIZE, UNITS)
    if GGML_TYPE == 8 or GGML_TYPE == 14:
        acc = tl.sum(acc_t, axis=1)
    else:
        acc = tl.sum(tl.sum(tl.sum(acc_t, axis=3), axis=2), axis=1)
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
        whose row size does not match or that are not aligned for word loads
        (:data:`_ALIGN`), an input that is not one row of ``in_features`` values,
        or an ``out`` that does not fit.
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
    align = _ALIGN[int(ggml_type)]
    if blocks.data_ptr() % align or blocks.stride(0) % align:
        raise ValueError(
            f"ggml type {ggml_type} blocks and their rows must start at multiples of "
            f"{align} bytes (the kernel reads them in words); copy them "
            "(blocks.clone()) to an aligned buffer"
        )
    if xr.data_ptr() % 16:
        # the kernel reads the input two or four values at a time
        xr = xr.clone()
    grid, ints, constexprs = _launch(
        n, in_features, ggml_type, _sm_count(x.device), launch, blocks.stride(0)
    )
    split_k = grid[1]
    counters, part = _scratch(x.device, grid[0], split_k * n) if split_k > 1 else (y, y)
    _qgemv_kernel[grid](xr, blocks, y, part, counters, *ints, **constexprs)
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
    :param launch: ``(block_n, split_k, num_warps[, units per step])`` instead of
        :func:`plan`'s and :data:`_STEPS`'.
    :param row_stride: bytes from one row of blocks to the next (default: the row's bytes).
    :return: ``(grid, (N, row_bytes, n_units, units_per_split, split_k), constexprs)``,
        ``constexprs`` holding ``num_warps`` too.
    """
    block_size, type_size = LAYOUTS[int(ggml_type)]
    units = in_features // block_size
    step = _STEPS[int(ggml_type)]
    if launch is None:
        block_n, split_k = plan(n, units, int(ggml_type), sms)
        num_warps = _WARPS[int(ggml_type)]
    else:
        block_n, split_k, num_warps, *rest = launch
        step = rest[0] if rest else step
    per_split = cdiv(cdiv(units, split_k), step) * step
    split_k = cdiv(units, per_split)
    constexprs = {
        "GGML_TYPE": int(ggml_type),
        "TYPE_SIZE": type_size,
        "UNITS": step,
        "BLOCK_N": block_n,
        "SPLIT": split_k > 1,
        "num_warps": num_warps,
    }
    row_stride = units * type_size if row_stride is None else row_stride
    ints = (n, row_stride, units, per_split, split_k)
    return (cdiv(n, block_n), split_k), ints, constexprs


def plan(n: int, units: int, ggml_type: int, sms: int) -> tuple[int, int]:
    """The one-row kernel's launch for ``n`` rows of ``units`` blocks each.

    Each program is one warp (:data:`_WARPS`) reading :data:`_STEPS` blocks of
    :data:`_ROW_BLOCK_N` rows per iteration, each thread several rows of the
    same positions (so each input value it loads serves them all). The
    reduction is split until about fifteen programs per multiprocessor run,
    keeping at least one step per split.

    :param n: output rows.
    :param units: blocks per row.
    :param ggml_type: the blocks' ggml type id.
    :param sms: the device's multiprocessor count.
    :return: ``(block_n, split_k)``, ``split_k`` a power of two.
    """
    block_n = _ROW_BLOCK_N[int(ggml_type)]
    step = _STEPS[int(ggml_type)]
    row_blocks = cdiv(n, block_n)
    split_k = 1
    while row_blocks * split_k < 15 * sms and units // (split_k * 2) >= step:
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
    _dequant_kernel[grid](
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
