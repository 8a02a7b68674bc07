"""Which backends take an FP8 (e4m3) KV cache, checked without a GPU.

``use_fp8_kv_cache`` must accept a model whose attention (or MLA) backend is
the Triton one (FlashInfer runs none of the tiny presets' head sizes: its
cache description is checked on a layer it runs), and every paged cache the model then describes
must be ``float8_e4m3fn``; the layers keep the scales they were given. The
kernels themselves run in ``tests/test_fp8_kv_triton.py`` (interpreter) and
``tests/test_fp8_kv_gpu.py`` (GPU).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from backplane.backends.torch.attention import TorchAttentionBackend
from backplane.backends.torch.delta import TorchDeltaBackend
from backplane.backends.torch.mla import TorchMLABackend
from backplane.backends.torch.ssm import TorchSSMBackend
from backplane.core.families import AttentionLayerSpec
from backplane.models import load_model
from backplane.models.mixers import AttentionMixer, MLAMixer
from backplane.models.quant.kv_cache import FP8_KV_BACKENDS, use_fp8_kv_cache

FP8 = torch.float8_e4m3fn


def _backend(family: str, name: str) -> Any:
    """A backend object of the GPU backends, constructed without running anything."""
    if name == "triton":
        pytest.importorskip("triton")
        if family == "attention":
            from backplane.backends.triton.attention import TritonAttentionBackend

            return TritonAttentionBackend()
        from backplane.backends.triton.mla import TritonMLABackend

        return TritonMLABackend()
    from backplane.backends.flashinfer.attention import FlashInferAttentionBackend

    return FlashInferAttentionBackend()


def _backends(**chosen: Any) -> dict[str, Any]:
    base = {
        "attention": TorchAttentionBackend(),
        "mla": TorchMLABackend(),
        "ssm": TorchSSMBackend(),
        "delta": TorchDeltaBackend(),
    }
    return {**base, **chosen}


@pytest.mark.parametrize(
    ("preset", "family", "name", "mixer"),
    [
        ("tiny-llama", "attention", "triton", AttentionMixer),
        ("tiny-deepseek-v3", "mla", "triton", MLAMixer),
    ],
)
def test_gpu_backends_take_an_fp8_kv_cache(preset, family, name, mixer) -> None:
    backend = _backend(family, name)
    assert backend.supports_fp8_kv_cache
    assert name in FP8_KV_BACKENDS[family]
    lm = load_model(
        preset, dtype="bfloat16", device="cpu", backends=_backends(**{family: backend})
    ).model
    layers = [m for m in lm.modules() if isinstance(m, mixer)]
    scales = {m.spec.layer_id: (0.5, 2.0) for m in layers}
    assert use_fp8_kv_cache(lm, scales) >= len(layers) > 0
    specs = lm.cache_specs(num_pages=3, page_size=16, num_slots=2, dtype=torch.bfloat16)
    cache_name = "kv_cache" if family == "attention" else "latent_cache"
    paged = [layer[cache_name] for layer in specs.values() if cache_name in layer]
    assert len(paged) == len(layers) and {s.dtype for s in paged} == {FP8}
    for m in layers:
        if family == "attention":
            assert (m.spec.k_scale, m.spec.v_scale) == (0.5, 2.0)
        else:
            assert m.spec.kv_scale == 0.5
        assert m.backend is backend


def test_flashinfer_describes_an_fp8_cache_of_a_supported_layer() -> None:
    backend = _backend("attention", "flashinfer")
    layer = AttentionLayerSpec(0, 8, 2, 128)
    spec = backend.cache_spec(layer, num_pages=4, page_size=16, dtype=FP8)["kv_cache"]
    assert spec.dtype == FP8 and spec.shape == (4, 2, 16, 2, 128)
