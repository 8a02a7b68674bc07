"""GGUF dequantisation in torch against the ``gguf`` package's numpy reference, every element."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from backplane.models.gguf.dequant import GGML_TYPES, dequantize  # noqa: E402
from backplane.models.gguf.reader import GGUFFile  # noqa: E402
from backplane.models.gguf.weights import unpermute_rows  # noqa: E402

QUANTISED = [t for t, layout in GGML_TYPES.items() if layout.block_size > 1]

# Byte offsets of the float16 fields of each block (scales, mins), which random
# bytes would fill with NaN or inf half the time.
_F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2)}


def random_blocks(ggml_type: int, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Random blocks of a quantised type with finite scales: ``[n_blocks, type_size]`` uint8."""
    layout = GGML_TYPES[ggml_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, layout.type_size), dtype=np.uint8)
    offsets = _F16_FIELDS.get(layout.name, (layout.type_size - 2,))  # Q6_K: d is last
    for off in offsets:
        scale = rng.normal(scale=0.05, size=(n_blocks, 1)).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8)
    return blocks


def reference(blocks: np.ndarray, ggml_type: int) -> np.ndarray:
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(ggml_type)).reshape(-1)


@pytest.mark.parametrize("ggml_type", QUANTISED, ids=lambda t: GGML_TYPES[t].name)
def test_block_types_match_gguf_reference_on_every_element(ggml_type):
    layout = GGML_TYPES[ggml_type]
    blocks = random_blocks(ggml_type, 96, seed=ggml_type)
    want = reference(blocks, ggml_type)
    rows = 96 * layout.block_size // 512
    got = dequantize(torch.from_numpy(blocks.reshape(-1).copy()), ggml_type, (rows, 512))
    assert got.dtype == torch.float32 and got.shape == (rows, 512)
    np.testing.assert_array_equal(got.reshape(-1).numpy(), want)


def _write_file(path, tensors):
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_file_tensors_of_every_type_read_back_as_gguf_reads_them(tmp_path):
    """Tensors quantised by ``gguf.quants.quantize`` where it can (random blocks for the
    k-quants), written with ``GGUFWriter``, read with backplane and with ``gguf``."""
    rng = np.random.default_rng(1)
    values = rng.normal(size=(8, 512)).astype(np.float32)
    q = gguf.GGMLQuantizationType
    tensors = {
        "f32.weight": (values, q.F32),
        "f16.weight": (values.astype(np.float16), q.F16),
        "bf16.weight": (gguf.quants.quantize(values, q.BF16), q.BF16),
    }
    for t in (q.Q8_0, q.Q4_0, q.Q4_1):
        tensors[f"{t.name.lower()}.weight"] = (gguf.quants.quantize(values, t), t)
    for t in (q.Q4_K, q.Q5_K, q.Q6_K):
        blocks = random_blocks(int(t), 16, seed=int(t)).reshape(8, -1)
        tensors[f"{t.name.lower()}.weight"] = (blocks, t)
    path = tmp_path / "types.gguf"
    _write_file(path, tensors)

    ours = GGUFFile(path)
    theirs = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert {t.name for t in ours.tensors} == set(tensors)
    for t in ours.tensors:
        ref = theirs[t.name]
        want = gguf.quants.dequantize(ref.data, ref.tensor_type).reshape(8, 512)
        got = dequantize(t.raw("cpu"), t.ggml_type, t.shape)
        assert t.shape == (8, 512), t.name
        np.testing.assert_array_equal(got.float().numpy(), want.astype(np.float32), err_msg=t.name)
    # the quantised encodings approximate the values they came from
    for name in ("q8_0.weight", "q4_0.weight", "q4_1.weight", "bf16.weight"):
        t = next(x for x in ours.tensors if x.name == name)
        got = dequantize(t.raw("cpu"), t.ggml_type, t.shape).float().numpy()
        assert np.abs(got - values).max() < 0.5, name


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("shape", [(4 * 16, 24), (4 * 16,)])
def test_unpermute_inverts_llama_cpp_permutation(shape):
    w = np.random.default_rng(2).normal(size=shape).astype(np.float32)
    permuted = torch.from_numpy(_llama_cpp_permute(w, 4))
    np.testing.assert_array_equal(unpermute_rows(permuted, 4).numpy(), w)


def test_unsupported_type_and_wrong_size_are_config_errors():
    from backplane.core.errors import ConfigError

    with pytest.raises(ConfigError, match="ggml tensor type 6 is not supported"):
        dequantize(torch.zeros(22, dtype=torch.uint8), 6, (32,))
    with pytest.raises(ConfigError, match="does not hold a tensor of shape"):
        dequantize(torch.zeros(33, dtype=torch.uint8), 8, (32,))
