"""Q4_K repacked for the one-row kernel (backplane.kernels.q4k_layout) against gguf's blocks.

The repacked layout must hold the same values: dequantising it gives, bit for
bit, ``gguf.quants.dequantize`` of the blocks it came from (random blocks of
several shapes, odd row counts, and blocks with extreme float16 ``d`` and
``dmin``, all-ones scale bytes and all-zero or all-fifteen nibbles). The quant
words are checked against the layout's definition (nibble ``s`` of word
``4 * g + w`` is value ``32 * g + 4 * s + w``) on weights whose dequantised
values are their quants, so a wrong nibble order fails here whatever the
kernels do. Pure torch on CPU; the ``gpu`` test repacks on CUDA too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_quant_helpers import QT, random_blocks  # noqa: E402

from backplane.kernels.q4k_layout import (  # noqa: E402
    PackedQ4K,
    dequantize_packed,
    packed_bits_per_weight,
    repack_q4k,
    unpack_quants,
)

#: (rows, values per row): one block, odd rows, several widths
SHAPES = [(1, 256), (7, 768), (33, 1024), (5, 4096)]


def _reference(blocks: np.ndarray) -> torch.Tensor:
    """gguf's float32 matrix of Q4_K blocks ``[rows, row bytes]``."""
    return torch.from_numpy(gguf.quants.dequantize(blocks, QT.Q4_K).astype(np.float32))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_round_trip(shape: tuple[int, int]) -> None:
    """Random blocks repacked dequantise to gguf's values exactly, in the documented shapes."""
    rows, cols = shape
    blocks = random_blocks(QT.Q4_K, rows, cols, np.random.default_rng(rows * cols))
    packed = repack_q4k(torch.from_numpy(blocks), cols)
    assert packed.qs.shape == (rows, cols // 8) and packed.qs.dtype == torch.int32
    assert packed.scales.shape == (rows, cols // 16) and packed.scales.dtype == torch.uint8
    assert packed.dm.shape == (rows, cols // 128) and packed.dm.dtype == torch.float16
    assert packed.shape == (rows, cols)
    assert packed.nbytes() * 8 == packed_bits_per_weight() * rows * cols == 4.625 * rows * cols
    assert torch.equal(dequantize_packed(packed), _reference(blocks))


def test_extreme_blocks() -> None:
    """Extreme float16 d/dmin (largest, smallest subnormal, negative, zero), saturated scale
    bytes and all-0 / all-15 nibbles survive the repacking exactly."""
    rng = np.random.default_rng(11)
    blocks = random_blocks(QT.Q4_K, 9, 512, rng).reshape(-1, 144)
    specials = np.array([65504.0, -65504.0, 2.0**-24, -(2.0**-24), 0.0, -0.0, 1.0, 0.5, 6.1e-5])
    halves = specials.astype(np.float16).view(np.uint8).reshape(-1, 2)
    n = blocks.shape[0]
    blocks[:, 0:2] = halves[np.arange(n) % len(halves)]
    blocks[:, 2:4] = halves[(np.arange(n) * 5 + 3) % len(halves)]
    blocks[::3, 4:16] = 0xFF  # every scale and min 63
    blocks[1::6, 16:] = 0xFF  # every nibble 15
    blocks[2::6, 16:] = 0x00  # every nibble 0
    blocks = blocks.reshape(9, -1)
    want = _reference(blocks)
    assert torch.isfinite(want).all()
    assert torch.equal(dequantize_packed(repack_q4k(torch.from_numpy(blocks), 512)), want)


def test_nibble_order() -> None:
    """Word ``4 * g + w`` of a row holds value ``32 * g + 4 * s + w`` in bits ``4s .. 4s + 3``.

    With ``d = 1``, every scale 1, ``dmin = 0`` and every min 0, gguf's values are the
    quants themselves: the words are read back with the definition (not the package's
    unpacking), so any other order of nibbles fails.
    """
    rows, cols = 6, 768
    rng = np.random.default_rng(3)
    blocks = random_blocks(QT.Q4_K, rows, cols, rng).reshape(-1, 144)
    blocks[:, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    blocks[:, 2:4] = 0  # dmin = 0
    # six-bit scales of 1 and mins of 0, packed as ggml does
    blocks[:, 4:8] = 1
    blocks[:, 8:12] = 0
    blocks[:, 12:16] = 0x01
    blocks = blocks.reshape(rows, -1)
    q = _reference(blocks).to(torch.int64)  # [rows, cols]: the quants, in value order
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    words = repack_q4k(torch.from_numpy(blocks), cols).qs.to(torch.int64) & 0xFFFFFFFF
    j = torch.arange(cols // 8)
    for s in range(8):
        value = 32 * (j // 4) + 4 * s + j % 4
        assert torch.equal((words >> (4 * s)) & 0xF, q[:, value]), f"nibble {s}"
    assert torch.equal(unpack_quants(repack_q4k(torch.from_numpy(blocks), cols).qs), q.byte())


def test_refusals() -> None:
    """Widths that are not whole blocks, and blocks of the wrong size, are refused."""
    with pytest.raises(ValueError, match="whole blocks"):
        repack_q4k(torch.zeros(2, 144, dtype=torch.uint8), 200)
    with pytest.raises(ValueError, match="288 bytes a row"):
        repack_q4k(torch.zeros(2, 144, dtype=torch.uint8), 512)
    with pytest.raises(ValueError, match="whole blocks"):
        repack_q4k(torch.zeros(2, 144, dtype=torch.int8), 256)


@pytest.mark.gpu
def test_repack_on_gpu() -> None:
    """Repacking on CUDA gives the CPU's tensors."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    blocks = torch.from_numpy(random_blocks(QT.Q4_K, 37, 1024, np.random.default_rng(1)))
    cpu = repack_q4k(blocks, 1024)
    gpu = repack_q4k(blocks.cuda(), 1024)
    assert isinstance(gpu, PackedQ4K) and gpu.device.type == "cuda"
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(a, b.cpu())
