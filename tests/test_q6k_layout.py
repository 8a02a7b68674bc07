"""Q6_K repacked for the one-row kernel (backplane.kernels.q6k_layout) against gguf's blocks.

The repacked layout must hold the same values: dequantising it gives, bit for
bit, ``gguf.quants.dequantize`` of the blocks it came from (random blocks of
several shapes, odd row counts, and blocks with extreme float16 ``d``, scales
of -128 and 127 and quants all 0 or all 63). The words are checked against
the layout's definition (the module docstring) on weights whose dequantised
values are their quants minus 32, and the scale bytes against the raw ones,
so a wrong bit order fails here whatever the kernels do. Pure torch on CPU;
the ``gpu`` test repacks on CUDA too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_quant_helpers import QT, random_blocks  # noqa: E402

from backplane.kernels.q6k_layout import (  # noqa: E402
    PackedQ6K,
    dequantize_packed_q6k,
    packed_bits_per_weight,
    repack_q6k,
    unpack_q6k,
)

#: (rows, values per row): one block, odd rows, several widths
SHAPES = [(1, 256), (7, 768), (33, 1024), (5, 4096), (3, 14336)]


def _reference(blocks: np.ndarray) -> torch.Tensor:
    """gguf's float32 matrix of Q6_K blocks ``[rows, row bytes]``."""
    return torch.from_numpy(gguf.quants.dequantize(blocks, QT.Q6_K).astype(np.float32))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_round_trip(shape: tuple[int, int]) -> None:
    """Random blocks repacked dequantise to gguf's values exactly, in the documented shapes."""
    rows, cols = shape
    blocks = random_blocks(QT.Q6_K, rows, cols, np.random.default_rng(rows * cols))
    packed = repack_q6k(torch.from_numpy(blocks), cols)
    assert packed.ql.shape == (rows, cols // 8) and packed.ql.dtype == torch.int32
    assert packed.qh.shape == (rows, cols // 16) and packed.qh.dtype == torch.int32
    assert packed.scales.shape == (rows, cols // 16) and packed.scales.dtype == torch.int8
    assert packed.d.shape == (rows, cols // 256) and packed.d.dtype == torch.float16
    assert all(t.is_contiguous() for t in packed)
    assert packed.shape == (rows, cols)
    assert packed.nbytes() == blocks.nbytes, "the layout is Q6_K's own size"
    assert packed.nbytes() * 8 == packed_bits_per_weight() * rows * cols == 6.5625 * rows * cols
    assert torch.equal(dequantize_packed_q6k(packed), _reference(blocks))


def test_extreme_blocks() -> None:
    """Extreme float16 d (largest, smallest subnormal, negative, zero), scales of -128 and
    127 and quants all 0 or all 63 survive the repacking exactly."""
    rng = np.random.default_rng(11)
    blocks = random_blocks(QT.Q6_K, 9, 512, rng).reshape(-1, 210)
    specials = np.array([65504.0, -65504.0, 2.0**-24, -(2.0**-24), 0.0, -0.0, 1.0, 0.5, 6.1e-5])
    halves = specials.astype(np.float16).view(np.uint8).reshape(-1, 2)
    n = blocks.shape[0]
    blocks[:, 208:210] = halves[np.arange(n) % len(halves)]
    blocks[::3, 192:208] = 0x80  # every scale -128
    blocks[1::3, 192:208] = 0x7F  # every scale 127
    blocks[1::4, :192] = 0xFF  # every quant 63
    blocks[2::4, :192] = 0x00  # every quant 0
    blocks = blocks.reshape(9, -1)
    want = _reference(blocks)
    assert torch.isfinite(want).all()
    assert torch.equal(dequantize_packed_q6k(repack_q6k(torch.from_numpy(blocks), 512)), want)


def _unit_blocks(rows: int, cols: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random Q6_K blocks with ``d = 1`` and every scale 1, and their quants (0..63) in value
    order: gguf's values are the quants minus 32."""
    blocks = random_blocks(QT.Q6_K, rows, cols, np.random.default_rng(seed)).reshape(-1, 210)
    blocks[:, 208:210] = np.array([1.0], np.float16).view(np.uint8)
    blocks[:, 192:208] = 1
    blocks = blocks.reshape(rows, -1)
    q = (_reference(blocks) + 32).to(torch.int64)
    assert int(q.min()) >= 0 and int(q.max()) <= 63
    return blocks, q


def test_bit_order() -> None:
    """The words hold each value's bits where the module docstring says.

    ``ql`` word ``4 * g + w``, bits ``4s .. 4s + 3``: the low nibble of value ``32g + 4s + w``;
    ``qh`` word ``16 * b + 4 * j + w``, bits ``4s .. 4s + 1``: the high pair of that value of
    group ``8b + j``, bits ``4s + 2 .. 4s + 3`` of group ``8b + j + 4``. The quants come
    from gguf's dequantisation (``d = 1``, scales 1) and the words are read with the
    definition, not the package's unpacking.
    """
    rows, cols = 6, 768
    blocks, q = _unit_blocks(rows, cols, 3)
    packed = repack_q6k(torch.from_numpy(blocks), cols)
    ql = packed.ql.to(torch.int64) & 0xFFFFFFFF
    qh = packed.qh.to(torch.int64) & 0xFFFFFFFF
    j = torch.arange(cols // 8)
    for s in range(8):
        value = 32 * (j // 4) + 4 * s + j % 4
        assert torch.equal((ql >> (4 * s)) & 0xF, q[:, value] & 0xF), f"ql nibble {s}"
    i = torch.arange(cols // 16)
    block, pair, w = i // 16, (i // 4) % 4, i % 4
    for s in range(8):
        for partner in range(2):
            value = 256 * block + 32 * (pair + 4 * partner) + 4 * s + w
            got = (qh >> (4 * s + 2 * partner)) & 3
            assert torch.equal(got, q[:, value] >> 4), f"qh pair {s}, partner {partner}"
    got_q, _ = unpack_q6k(packed)
    assert torch.equal(got_q, q.byte())


def test_scale_order() -> None:
    """Scale byte ``16 * b + 4 * j + i`` is ggml's scale of sub-block ``2j``, ``2j + 1``,
    ``2j + 8``, ``2j + 9`` of super-block ``b`` for ``i`` = 0..3; ``d`` is ggml's."""
    rows, cols = 5, 1024
    blocks = random_blocks(QT.Q6_K, rows, cols, np.random.default_rng(4))
    raw = torch.from_numpy(blocks).reshape(rows, cols // 256, 210)
    raw_scales = raw[..., 192:208].reshape(rows, -1).view(torch.int8)
    packed = repack_q6k(torch.from_numpy(blocks), cols)
    i = torch.arange(cols // 16)
    block, pair, which = i // 16, (i // 4) % 4, i % 4
    sub = 16 * block + 2 * pair + torch.tensor([0, 1, 8, 9])[which]
    assert torch.equal(packed.scales, raw_scales[:, sub])
    assert torch.equal(packed.d, raw[..., 208:210].contiguous().view(torch.float16)[..., 0])
    _, sc = unpack_q6k(packed)
    assert torch.equal(sc, raw_scales)


def test_refusals() -> None:
    """Widths that are not whole blocks, and blocks of the wrong size or dtype, are refused."""
    with pytest.raises(ValueError, match="whole blocks"):
        repack_q6k(torch.zeros(2, 210, dtype=torch.uint8), 200)
    with pytest.raises(ValueError, match="420 bytes a row"):
        repack_q6k(torch.zeros(2, 210, dtype=torch.uint8), 512)
    with pytest.raises(ValueError, match="whole blocks"):
        repack_q6k(torch.zeros(2, 210, dtype=torch.int8), 256)
    with pytest.raises(ValueError, match="whole blocks"):
        repack_q6k(torch.zeros(210, dtype=torch.uint8), 256)


@pytest.mark.gpu
def test_repack_on_gpu() -> None:
    """Repacking on CUDA gives the CPU's tensors."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    blocks = torch.from_numpy(random_blocks(QT.Q6_K, 37, 1024, np.random.default_rng(1)))
    cpu = repack_q6k(blocks, 1024)
    gpu = repack_q6k(blocks.cuda(), 1024)
    assert isinstance(gpu, PackedQ6K) and gpu.device.type == "cuda"
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(a, b.cpu())
