"""GGUF Q6_K weights repacked for the one-row kernel of :mod:`.qgemv_packed_q6k` (torch only).

ggml's Q6_K block (210 bytes per 256 values: 128 bytes of low nibbles, 64
bytes of high bit pairs, sixteen int8 scales of 16-value sub-blocks, a
float16 ``d``) spreads each value's six bits over two bytes that hold other
values in other orders. :func:`repack_q6k` rearranges the bits into
:class:`PackedQ6K` so that a GPU thread reads everything of two 32-value
groups with three 16-byte loads, one 4-byte load and one 2-byte load, without
changing any value (``(d * scale) * (q - 32)`` is the same float32
computation on the same numbers, see :func:`dequantize_packed_q6k`):

- ``ql``, int32 ``[rows, K / 8]``: the low nibbles, in exactly the word
  layout of :class:`~backplane.kernels.q4k_layout.PackedQ4K` ``qs``: word
  ``4 * g + w`` (``g`` a 32-value group, ``w`` in ``0..3``) holds value
  ``32 * g + 4 * s + w`` in bits ``4 * s .. 4 * s + 3``;
- ``qh``, int32 ``[rows, K / 16]``: the high bit pairs of two groups of one
  super-block, group ``a = 8 * b + j`` and its partner ``a + 4`` (``b`` the
  super-block, ``j`` in ``0..3``): word ``16 * b + 4 * j + w`` holds the
  pair of value ``(s, w)`` of group ``a`` in bits ``4 * s .. 4 * s + 1`` and
  of group ``a + 4`` in bits ``4 * s + 2 .. 4 * s + 3``;
- ``scales``, int8 ``[rows, K / 16]``: bytes ``16 * b + 4 * j + 0..3`` are the
  scales of the sub-blocks ``2a``, ``2a + 1``, ``2a + 8``, ``2a + 9`` of the
  super-block (group ``a``'s two halves, then its partner's): one 32-bit load;
- ``d``, float16 ``[rows, K / 256]``: each super-block's ``d``.

That is 128 + 64 + 16 + 2 = 210 bytes per 256 values, 6.5625 bits a weight,
Q6_K's own size. The high pairs sit one nibble position apart from nothing
else of their group: shifted left by 4 (by 2 for the partner) a word puts the
pair of value ``(s, w)`` just above the low nibble of ``ql`` word ``w``, so
the kernel ORs the two masked fields into the six-bit quant in place (one
more ``LOP3`` a weight and one multiply-add, against two of each to multiply
the two parts separately).

Why groups ``a`` and ``a + 4`` of one super-block, and not the halves of the
kernel's chunk as :mod:`.qgemv_packed` pairs Q4_K's groups: the pairing is
then a property of the weight, not of the launch (any chunk of whole
super-blocks reads it, a row of any number of super-blocks is whole pairs),
the two groups share one ``d``, and the loads stay whole sectors: a warp's
``ql`` loads for the first groups of its pairs cover the first 64 bytes of
each super-block's 128, those for the partners the other 64; its ``qh``,
scale and ``d`` loads are contiguous.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from backplane.kernels.q4k_layout import pack_quants, unpack_quants

#: values per Q6_K super-block, and its bytes
QK_K = 256
Q6K_BLOCK_BYTES = 210
#: values per sub-block (one scale)
SUB_BLOCK = 16
#: groups from one group of a ``qh`` pair to its partner
PARTNER = 4


class PackedQ6K(NamedTuple):
    """A Q6_K matrix in the layout of the module docstring.

    :param ql: int32 ``[rows, K / 8]`` words of low nibbles.
    :param qh: int32 ``[rows, K / 16]`` words of high bit pairs, two groups a word.
    :param scales: int8 ``[rows, K / 16]``: the sub-blocks' scales, four per pair of groups.
    :param d: float16 ``[rows, K / 256]``: each super-block's ``d``.
    """

    ql: torch.Tensor
    qh: torch.Tensor
    scales: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, values per row)``."""
        return self.ql.shape[0], self.ql.shape[1] * 8

    @property
    def device(self) -> torch.device:
        """Where the tensors live."""
        return self.ql.device

    def nbytes(self) -> int:
        """Bytes of the four tensors."""
        return sum(t.numel() * t.element_size() for t in self)


def packed_bits_per_weight() -> float:
    """Bits a weight of :class:`PackedQ6K` takes (quants, sub-block scales, ``d``)."""
    return 8 * (QK_K // 2 + QK_K // 4 + QK_K // SUB_BLOCK + 2) / QK_K


def _pairs(t: torch.Tensor) -> torch.Tensor:
    """``[rows, super-blocks, 8 groups, ...]`` -> ``[rows, super-blocks, 4 pairs, 2, ...]``:
    group ``j`` and its partner ``j + 4`` side by side."""
    n, nb = t.shape[:2]
    return t.reshape(n, nb, 2, PARTNER, *t.shape[3:]).transpose(2, 3)


def repack_q6k(blocks: torch.Tensor, in_features: int) -> PackedQ6K:
    """Rearrange a matrix of raw Q6_K blocks into :class:`PackedQ6K` (on their device).

    :param blocks: uint8 ``[rows, in_features / 256 * 210]``, ggml's bytes row by row.
    :param in_features: values per row, a multiple of 256.
    :return: the same values in the packed layout (new tensors; ``blocks`` is untouched).
    :raises ValueError: a width that is not whole blocks, or blocks of another size.
    """
    if in_features % QK_K or blocks.dim() != 2 or blocks.dtype != torch.uint8:
        raise ValueError(
            f"Q6_K rows are whole blocks of {QK_K} values; got {in_features} values and "
            f"blocks of shape {tuple(blocks.shape)} {blocks.dtype}"
        )
    n, nb = blocks.shape[0], in_features // QK_K
    if blocks.shape[1] != nb * Q6K_BLOCK_BYTES:
        raise ValueError(
            f"{in_features} Q6_K values take {nb * Q6K_BLOCK_BYTES} bytes a row, not "
            f"{blocks.shape[1]}"
        )
    b = blocks.reshape(n, nb, Q6K_BLOCK_BYTES)
    # ggml: in each 128-value half, ql byte l holds value l (low nibble) and value 64 + l
    # (high); qh byte l holds values l, 32 + l, 64 + l, 96 + l in its bit pairs 0..3
    ql = b[..., :128].reshape(n, nb, 2, 1, 64)
    lo = torch.cat([ql & 0xF, ql >> 4], dim=3).reshape(n, in_features)
    qh = b[..., 128:192].reshape(n, nb, 2, 1, 32)
    hi = torch.cat([(qh >> (2 * i)) & 3 for i in range(4)], dim=3).reshape(n, nb, 8, 8, 4)
    # a pair's high bits as the nibbles of one 32-value "group": (group a) | (partner << 2)
    hp = _pairs(hi)  # [n, nb, pair, 2, s, w]
    qh_words = pack_quants((hp[:, :, :, 0] | (hp[:, :, :, 1] << 2)).reshape(n, -1))
    sc = _pairs(b[..., 192:208].reshape(n, nb, 8, 2))  # [n, nb, pair, 2, half]
    scales = sc.reshape(n, nb * 16).view(torch.int8)
    d = b[..., 208:210].contiguous().view(torch.float16).reshape(n, nb)
    return PackedQ6K(ql=pack_quants(lo), qh=qh_words, scales=scales.contiguous(), d=d)


def unpack_q6k(packed: PackedQ6K) -> tuple[torch.Tensor, torch.Tensor]:
    """The six-bit quants of ``packed`` in value order, uint8 ``[rows, K]`` (0..63), and its
    sub-block scales in ggml's order, int8 ``[rows, K / 16]``."""
    n, k = packed.shape
    nb = k // QK_K
    lo = unpack_quants(packed.ql)
    nib = unpack_quants(packed.qh).reshape(n, nb, PARTNER, 1, 8, 4)
    hp = torch.cat([nib & 3, nib >> 2], dim=3)  # [n, nb, pair, 2, s, w]
    hi = hp.transpose(2, 3).reshape(n, k)
    sc = packed.scales.reshape(n, nb, PARTNER, 2, 2).transpose(2, 3).reshape(n, k // SUB_BLOCK)
    return lo | (hi << 4), sc


def dequantize_packed_q6k(packed: PackedQ6K) -> torch.Tensor:
    """The float32 matrix of ``packed``, with ggml's arithmetic: ``(d * scale) * (q - 32)`` per
    value (equal, bit for bit, to dequantising the blocks it was packed from).

    :param packed: a packed Q6_K matrix.
    :return: float32 ``[rows, K]`` on its device.
    """
    n, k = packed.shape
    q, sc = unpack_q6k(packed)
    d = packed.d.float().reshape(n, k // QK_K, 1)
    scale = (d * sc.reshape(n, k // QK_K, QK_K // SUB_BLOCK).float()).reshape(n, -1, 1)
    return (scale * (q.reshape(n, -1, SUB_BLOCK).float() - 32)).reshape(n, k)
