"""GGUF Q4_K weights repacked for the one-row kernel of :mod:`.qgemv_packed` (torch only).

ggml's Q4_K block (144 bytes per 256 values: float16 ``d`` and ``dmin``, the
eight 6-bit scales and mins of its 32-value groups packed in 12 bytes, then
128 bytes of nibbles pairing group ``2c`` with group ``2c + 1``) is laid out
for a CPU reading one block at a time. A GPU program reading a tile of rows
wants whole words of quants it can load 16 bytes at a time and unpack with
one shift each, and scales it can read without decoding bit fields.
:func:`repack_q4k` rearranges the bits into :class:`PackedQ4K`, without
changing any value (``(d * scale) * q - dmin * min`` is the same float32
computation on the same numbers, see :func:`dequantize_packed`):

- ``qs``, int32 ``[rows, K / 8]``: word ``4 * g + w`` (``g`` a 32-value
  group, ``w`` in ``0..3``) holds the group's values ``32 * g + 4 * s + w``
  in bits ``4 * s .. 4 * s + 3`` for ``s`` in ``0..7``. A thread that loads
  the group's four words as one 16-byte vector finds, at each shift ``s``,
  four consecutive values, which it multiplies by four consecutive inputs;
- ``scales``, uint8 ``[rows, K / 16]``: bytes ``2 * g`` and ``2 * g + 1``
  are group ``g``'s 6-bit scale and min (one 16-bit load a group);
- ``dm``, float16 ``[rows, K / 128]``: ``d`` and ``dmin`` of each 256-value
  super-block, side by side (one 32-bit load).

That is 128 + 16 + 4 = 148 bytes per 256 values, 4.625 bits a weight against
Q4_K's 4.5. Pre-multiplied float16 ``d * scale`` and ``dmin * min`` per group
would save the kernel two conversions and two multiplies of the ~95
instructions a thread spends on a group of a row (4%), for 5 bits a weight:
8% more bytes to stream, where the bytes set the time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

#: values per Q4_K super-block, and its bytes
QK_K = 256
Q4K_BLOCK_BYTES = 144
#: values per group (one scale and min)
GROUP = 32


class PackedQ4K(NamedTuple):
    """A Q4_K matrix in the layout of the module docstring.

    :param qs: int32 ``[rows, K / 8]`` quant words.
    :param scales: uint8 ``[rows, K / 16]``: each group's 6-bit scale and min.
    :param dm: float16 ``[rows, K / 128]``: each super-block's ``d`` and ``dmin``.
    """

    qs: torch.Tensor
    scales: torch.Tensor
    dm: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, values per row)``."""
        return self.qs.shape[0], self.qs.shape[1] * 8

    @property
    def device(self) -> torch.device:
        """Where the tensors live."""
        return self.qs.device

    def nbytes(self) -> int:
        """Bytes of the three tensors."""
        return sum(t.numel() * t.element_size() for t in self)


def packed_bits_per_weight() -> float:
    """Bits a weight of :class:`PackedQ4K` takes (quants, group scales and mins, ``d``/``dmin``)."""
    return 8 * (QK_K // 2 + QK_K // GROUP * 2 + 4) / QK_K


def _scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of each block's 12 bytes ``[..., 12]`` -> two ``[..., 8]``
    uint8 (ggml's ``get_scale_min_k4``)."""
    s = packed.reshape(*packed.shape[:-1], 3, 4)
    d, m, m_d = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def repack_q4k(blocks: torch.Tensor, in_features: int) -> PackedQ4K:
    """Rearrange a matrix of raw Q4_K blocks into :class:`PackedQ4K` (on their device).

    :param blocks: uint8 ``[rows, in_features / 256 * 144]``, ggml's bytes row by row.
    :param in_features: values per row, a multiple of 256.
    :return: the same values in the packed layout (new tensors; ``blocks`` is untouched).
    :raises ValueError: a width that is not whole blocks, or blocks of another size.
    """
    if in_features % QK_K or blocks.dim() != 2 or blocks.dtype != torch.uint8:
        raise ValueError(
            f"Q4_K rows are whole blocks of {QK_K} values; got {in_features} values and "
            f"blocks of shape {tuple(blocks.shape)} {blocks.dtype}"
        )
    n, nb = blocks.shape[0], in_features // QK_K
    if blocks.shape[1] != nb * Q4K_BLOCK_BYTES:
        raise ValueError(
            f"{in_features} Q4_K values take {nb * Q4K_BLOCK_BYTES} bytes a row, not "
            f"{blocks.shape[1]}"
        )
    b = blocks.reshape(n, nb, Q4K_BLOCK_BYTES)
    dm = b[..., :4].contiguous().view(torch.float16).reshape(n, nb * 2)
    sc, mn = _scale_min(b[..., 4:16])
    scales = torch.stack([sc, mn], dim=-1).reshape(n, nb * 16)
    # ggml: byte 32 * c + l holds value l of group 2c (low nibble) and of group 2c + 1 (high)
    nib = b[..., 16:].reshape(n, nb, 4, 1, 32)
    q = torch.cat([nib & 0xF, nib >> 4], dim=3).reshape(n, in_features)
    return PackedQ4K(qs=pack_quants(q), scales=scales.contiguous(), dm=dm)


def pack_quants(q: torch.Tensor) -> torch.Tensor:
    """4-bit quants in value order, uint8 ``[rows, K]`` (each below 16), into the words of
    ``qs``, int32 ``[rows, K / 8]`` (the inverse of :func:`unpack_quants`)."""
    n = q.shape[0]
    # word w of a group holds value 4 * s + w at nibble s; nibbles 2j and 2j + 1 share byte j
    q = q.reshape(n, -1, 8, 4).transpose(2, 3)  # [n, group, s, w] -> [n, group, w, s]
    word_bytes = q[..., 0::2] | (q[..., 1::2] << 4)  # [n, group, w, 4 bytes], little-endian
    return word_bytes.contiguous().view(torch.int32).reshape(n, -1)


def unpack_quants(qs: torch.Tensor) -> torch.Tensor:
    """The 4-bit quants of ``qs`` (int32 ``[rows, K / 8]``) in value order, uint8 ``[rows, K]``."""
    n = qs.shape[0]
    word_bytes = qs.contiguous().view(torch.uint8).reshape(n, -1, 4, 4)  # [n, group, w, byte]
    q = torch.stack([word_bytes & 0xF, word_bytes >> 4], dim=-1).reshape(n, -1, 4, 8)
    return q.transpose(2, 3).reshape(n, -1)  # [n, group, s, w] -> value 32g + 4s + w


def dequantize_packed(packed: PackedQ4K) -> torch.Tensor:
    """The float32 matrix of ``packed``, with ggml's arithmetic: ``(d * scale) * q - dmin * min``
    per value (equal, bit for bit, to dequantising the blocks it was packed from).

    :param packed: a packed Q4_K matrix.
    :return: float32 ``[rows, K]`` on its device.
    """
    n, k = packed.shape
    dm = packed.dm.reshape(n, k // QK_K, 1, 2).float()
    sm = packed.scales.reshape(n, k // QK_K, 8, 2).float()
    scale = (dm[..., 0] * sm[..., 0]).reshape(n, -1, 1)
    offset = (dm[..., 1] * sm[..., 1]).reshape(n, -1, 1)
    q = unpack_quants(packed.qs).reshape(n, -1, GROUP).float()
    return (scale * q - offset).reshape(n, k)
