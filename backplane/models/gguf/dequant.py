"""Dequantisation of GGUF tensor data in torch, vectorised over blocks, on any device.

Each GGML type stores a tensor as a run of fixed-size blocks (bytes) that each
hold a fixed number of elements. The functions here turn the raw bytes of a
tensor (a 1-D ``uint8`` tensor, already on the target device) into float32
values with whole-tensor torch operations: no loop over blocks, so a tensor is
dequantised where it will live. The arithmetic follows ggml's reference
dequantisation (the order of the multiplications and additions included), so
results are the same float32 values ggml and the ``gguf`` package compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from backplane.core.errors import ConfigError

QK_K = 256  # elements per super-block of the k-quants


@dataclass(frozen=True)
class GGMLType:
    """One GGML tensor type: its name and block layout.

    :param name: ggml's name (``Q4_K``...).
    :param block_size: elements per block.
    :param type_size: bytes per block.
    """

    name: str
    block_size: int
    type_size: int


#: ggml type id -> layout of the types backplane reads (ids from ggml.h)
GGML_TYPES: dict[int, GGMLType] = {
    0: GGMLType("F32", 1, 4),
    1: GGMLType("F16", 1, 2),
    2: GGMLType("Q4_0", 32, 2 + 16),
    3: GGMLType("Q4_1", 32, 2 + 2 + 16),
    8: GGMLType("Q8_0", 32, 2 + 32),
    12: GGMLType("Q4_K", QK_K, 2 + 2 + 12 + QK_K // 2),
    13: GGMLType("Q5_K", QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    14: GGMLType("Q6_K", QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    30: GGMLType("BF16", 1, 2),
}


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of every block, as float32 ``[n, 1]``."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _bit_fields(x: torch.Tensor, group: int, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """Unpack bit fields: ``[n, g * group]`` bytes -> ``[n, g, len(shifts), group]``.

    Field ``j`` of byte ``i`` in each run of ``group`` bytes is ``(byte >> shifts[j]) & mask``;
    ggml stores field ``j`` of a run as the ``j``-th ``group`` elements of it.
    One shift per field concatenated is faster on CPU than a broadcast shift.
    """
    n = x.shape[0]
    runs = x.reshape(n, -1, 1, group)
    return torch.cat([(runs >> s) & mask if s else runs & mask for s in shifts], dim=2)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Low then high nibbles of each run of ``group`` bytes: ``[n, g, 2, group]``."""
    return _bit_fields(qs, group, (0, 4), 0x0F)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    x = blocks[:, 2:].contiguous().view(torch.int8).float()
    return x * d


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:], 16).reshape(n, -1).to(torch.int8) - 8
    return d * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    m = _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:], 16).reshape(n, -1).float()
    return (d * q) + m


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed in 12 bytes (Q4_K, Q5_K), as float32 ``[n, 8]``."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    dmin = _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    scale = (d * sc).reshape(n, -1, 1)
    offset = (dmin * mn).reshape(n, -1, 1)
    q = _nibbles(blocks[:, 16:], 32).reshape(n, -1, 32).float()
    return (scale * q - offset).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    dmin = _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    qh = blocks[:, 16 : 16 + QK_K // 8]
    qs = blocks[:, 16 + QK_K // 8 :]
    scale = (d * sc).reshape(n, -1, 1)
    offset = (dmin * mn).reshape(n, -1, 1)
    low = _nibbles(qs, 32).reshape(n, -1, 32)
    high = _bit_fields(qh, 32, tuple(range(8)), 1)
    q = (low | (high.reshape(n, -1, 32) << 4)).float()
    return (scale * q - offset).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = blocks[:, : QK_K // 2]
    qh = blocks[:, QK_K // 2 : QK_K // 2 + QK_K // 4]
    scales = blocks[:, QK_K // 2 + QK_K // 4 : QK_K // 2 + QK_K // 4 + QK_K // 16]
    d = _f16(blocks, QK_K // 2 + QK_K // 4 + QK_K // 16)
    scale = (d * scales.contiguous().view(torch.int8).float()).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql, 64).reshape(n, -1, 32)
    high = _bit_fields(qh, 32, (0, 2, 4, 6), 3)
    q = (low | (high.reshape(n, -1, 32) << 4)).to(torch.int8) - 32
    return (scale * q.reshape(n, QK_K // 16, -1).float()).reshape(n, QK_K)


_BLOCK_DEQUANT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def supported_types() -> list[str]:
    """Names of the GGML types :func:`dequantize` reads."""
    return [t.name for t in GGML_TYPES.values()]


def dequantize(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Turn the raw bytes of one GGUF tensor into float32 values (bfloat16/float16 kept as is).

    :param raw: the tensor's bytes as a 1-D ``uint8`` tensor, on the device the
        result should be on.
    :param ggml_type: the tensor's ggml type id.
    :param shape: the tensor's shape in torch order (row-major, the reverse of
        the GGUF dimension list).
    :return: a tensor of ``shape`` on ``raw``'s device: float32, or bfloat16 /
        float16 for tensors stored that way (the loader casts on copy).
    :raises ConfigError: an unsupported type, or a byte count that does not fit the shape.
    """
    layout = GGML_TYPES.get(int(ggml_type))
    if layout is None:
        raise ConfigError(
            f"ggml tensor type {ggml_type} is not supported; backplane reads "
            f"{', '.join(supported_types())}: re-quantise the model to one of those"
        )
    numel = 1
    for s in shape:
        numel *= int(s)
    if numel % layout.block_size or raw.numel() != numel // layout.block_size * layout.type_size:
        raise ConfigError(
            f"{layout.name} data of {raw.numel()} bytes does not hold a tensor of shape "
            f"{tuple(shape)}; the file is damaged"
        )
    if layout.name == "F32":
        return raw.view(torch.float32).reshape(shape)
    if layout.name == "F16":
        return raw.view(torch.float16).reshape(shape)
    if layout.name == "BF16":
        return raw.view(torch.bfloat16).reshape(shape)
    blocks = raw.reshape(-1, layout.type_size)
    return _BLOCK_DEQUANT[layout.name](blocks).reshape(shape)
