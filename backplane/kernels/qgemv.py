"""A one-row product with a GGUF-quantised weight, dequantised in registers (batch-1 decode).

At one input row a projection's time is the bytes of its weight over the
memory bandwidth, so a weight kept as GGUF blocks (Q4_K: 4.5 bits a value)
is read in about a quarter of the time of its bfloat16 form, provided the
blocks are dequantised where they are read rather than into a float matrix
first. :func:`quantized_gemv` does that: each program owns ``BLOCK_N`` output
rows and walks their blocks in tiles of ``TILE`` values, gathering each
value's quant bits, its sub-block scale (and min) and its block's float16
scale from the raw bytes, multiplying by the input and accumulating in
float32. Output rows are written in the input's dtype.

For several input rows a GEMM is compute-bound enough that the blocks can be
expanded first: :func:`dequantize_blocks` writes the matrix in the input's
dtype with the same per-value decoding, in one kernel, for the caller to
multiply (and drop).

The byte layouts are ggml's (see :mod:`backplane.models.gguf.dequant`, whose
torch code is the reference the tests hold this kernel to); the arithmetic
keeps its order (``(d * scale) * q - dmin * min``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backplane.core.launch import cdiv

#: ggml type ids the kernel reads -> (values per block, bytes per block)
LAYOUTS: dict[int, tuple[int, int]] = {
    8: (32, 34),  # Q8_0
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
}

#: dtypes of the input (and output) the kernel takes
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_TILE = 256  # values per step along a row: one k-quant super-block, eight Q8_0 blocks
_BLOCK_N = 16  # output rows per program


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
def _qgemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    N,
    K,
    row_bytes,
    GGML_TYPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_base = rows.to(tl.int64)[:, None] * row_bytes
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, TILE):
        k = k0 + tl.arange(0, TILE)
        k_ok = k < K
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        mask = row_ok[:, None] & k_ok[None, :]
        base = w_ptr + row_base + ((k // BLOCK_SIZE) * TYPE_SIZE)[None, :]
        w = _dequant_tile(base, (k % BLOCK_SIZE)[None, :], mask, GGML_TYPE)
        acc += tl.sum(tl.where(mask, w, 0.0) * x[None, :], axis=1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)


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
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, in_features: int
) -> torch.Tensor:
    """``x @ dequant(blocks).T`` for one input row, dequantising in the kernel.

    :param x: ``[1, in_features]`` (or ``[in_features]``), on the blocks' device.
    :param blocks: the weight's raw GGUF blocks ``[out_features, row_bytes]`` ``uint8``,
        rows contiguous.
    :param ggml_type: their ggml type id (see :func:`supports`).
    :param in_features: values per weight row.
    :return: ``[1, out_features]`` in ``x``'s dtype.
    :raises ValueError: a type, width or dtype :func:`supports` refuses, or
        blocks whose row size does not match.
    """
    _check(blocks, ggml_type, in_features, x.dtype)
    n = blocks.shape[0]
    xr = x.reshape(-1).contiguous()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _qgemv_kernel[(cdiv(n, _BLOCK_N),)](
        xr,
        blocks,
        y,
        n,
        in_features,
        blocks.stride(0),
        **_constants(ggml_type),
    )
    return y


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
