"""GGUF blocks for the quantised-projection tests: random blocks, and k-quant encoders.

The ``gguf`` package quantises to Q8_0 in Python but not to the k-quants
(``Q4_K``, ``Q5_K``, ``Q6_K`` have only a reference *de*quantisation there), so
:func:`quantize` encodes them here with plain round-to-nearest scales and mins
per sub-block (llama.cpp searches its scales more carefully, so its files are a
little more accurate). The encoders are independent of backplane's code and
their byte layout is checked by decoding with ``gguf.quants.dequantize``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
QK_K = 256

#: byte offsets of each block's float16 scales, per type (kept finite in random blocks)
_F16_AT = {QT.Q8_0: (0,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}


def random_blocks(
    qtype: QT, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.01
) -> np.ndarray:
    """Random bytes laid out as ``[rows, row bytes]`` blocks of ``qtype``, with small finite
    float16 scales (every other bit pattern is a valid quantised value)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in _F16_AT[qtype]:
        d = (rng.random(n) * scale + scale / 10).astype(np.float16)
        raw[:, off : off + 2] = d.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` as float16 bytes ``[n, 2]`` and the float32 value they hold."""
    h = x.astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def _scales_mins(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K: the block's d, dmin (float16 bytes and values), 6-bit scales and mins
    of its eight 32-value sub-blocks, and the quants ``[n, 8, 32]`` in ``0..levels``."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / levels
    d_b, d = _f16(scale.max(-1) / 63)
    m_b, dmin = _f16((-lo).max(-1) / 63)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(-lo, dmin[:, None])), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    offset = (dmin[:, None] * mn)[..., None]
    q = np.clip(np.rint(_safe_div(sub + offset, step)), 0, levels).astype(np.uint8)
    packed = np.empty((x.shape[0], 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return d_b, m_b, packed, q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Eight 32-value sub-blocks ``[n, 8, 32]`` -> 128 bytes: pairs of sub-blocks share bytes."""
    low, high = q[:, 0::2] & 0xF, q[:, 1::2] & 0xF
    return (low | (high << 4)).reshape(q.shape[0], 128)


def _q4_k(x: np.ndarray) -> np.ndarray:
    d_b, m_b, scales, q = _scales_mins(x, 15)
    return np.concatenate([d_b, m_b, scales, _nibbles(q)], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d_b, m_b, scales, q = _scales_mins(x, 31)
    high = (q >> 4) & 1  # [n, 8, 32]: bit j of byte l is sub-block j's fifth bit
    qh = np.zeros((x.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate([d_b, m_b, scales, qh, _nibbles(q)], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    amax_at = np.abs(sub).argmax(-1)
    amax = np.take_along_axis(sub, amax_at[..., None], -1)[..., 0]
    scale = amax / -32  # the largest value maps to -32, as ggml does
    big = np.abs(scale).max(-1)
    d_b, d = _f16(np.where(big > 0, big / 127, 0.0))
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), -128, 127).astype(np.int8)
    step = (d[:, None] * sc.astype(np.float32))[..., None]
    q = (np.clip(np.rint(_safe_div(sub, step)), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    ql = np.zeros((n, 128), np.uint8)
    qh = np.zeros((n, 64), np.uint8)
    for half in range(2):
        for quarter in range(4):
            v = q[:, half * 128 + quarter * 32 : half * 128 + quarter * 32 + 32]
            lo = half * 64 + (quarter % 2) * 32
            ql[:, lo : lo + 32] |= (v & 0xF) << ((quarter // 2) * 4)
            qh[:, half * 32 : half * 32 + 32] |= ((v >> 4) & 3) << (quarter * 2)
    return np.concatenate([ql, qh, sc.view(np.uint8), d_b], axis=1)


_ENCODERS = {QT.Q4_K: _q4_k, QT.Q5_K: _q5_k, QT.Q6_K: _q6_k}


def quantize(w: np.ndarray, qtype: QT) -> np.ndarray:
    """Quantise a float matrix ``[rows, cols]`` to ``qtype``'s blocks ``[rows, row bytes]``
    (Q8_0 by ``gguf.quants``; the k-quants by the encoders above)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype not in _ENCODERS:
        return gguf.quants.quantize(w, qtype)
    rows = w.shape[0]
    return _ENCODERS[qtype](w.reshape(-1, QK_K)).reshape(rows, -1)


def requantize(
    src: str | Path, dst: str | Path, type_of: Callable[[str, tuple[int, ...]], QT | None]
) -> Path:
    """Copy a GGUF file with its tensors re-encoded: every metadata field as it is, each
    tensor dequantised by ``gguf`` and written as ``type_of(name, shape)`` (float32 for
    ``None``).

    :param src: the file to copy.
    :param dst: where to write.
    :param type_of: the type of each tensor, from its GGUF name and torch-order shape.
    :return: ``dst``.
    """
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(reversed([int(d) for d in t.shape])))
        qtype = type_of(t.name, w.shape) if w.ndim == 2 else None
        if qtype is None:
            writer.add_tensor(t.name, w)
        else:
            writer.add_tensor(t.name, quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)
