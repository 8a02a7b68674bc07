"""FP8 (e4m3) KV caches of the GPU backends, on a GPU: the conformance kit's suites.

Every backend here declares ``supports_fp8_kv_cache``, so the kit's
``test_fp8_kv_cache`` cases run for it (new rows bit for bit as
:func:`backplane.testing.fp8.to_fp8` rounds them, output against the float64
reference over the dequantised cache), with the rest of its family's suite.
Run with ``python -m pytest -m gpu tests/test_fp8_kv_gpu.py``; e4m3 needs a
GPU of compute capability 8.9 or newer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from backplane.testing.attention import AttentionBackendTests
from backplane.testing.mla import MLABackendTests

pytestmark = pytest.mark.gpu


def _needs_e4m3() -> None:
    """Skip unless a CUDA device that converts to e4m3 (sm89+) is present."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 conversions need compute capability 8.9 or newer")


@pytest.fixture(params=["triton", "flashinfer"])
def attention_backend(request: pytest.FixtureRequest) -> Any:
    """The Triton or the FlashInfer attention backend."""
    _needs_e4m3()
    if request.param == "triton":
        pytest.importorskip("triton")
        from backplane.backends.triton.attention import TritonAttentionBackend

        return TritonAttentionBackend()
    pytest.importorskip("flashinfer")
    from backplane.backends.flashinfer.attention import FlashInferAttentionBackend

    return FlashInferAttentionBackend()


class TestFp8Attention(AttentionBackendTests):
    """The attention suite, its FP8 KV-cache case included, for the GPU backends."""

    @pytest.fixture
    def backend(self, attention_backend: Any) -> Any:
        """The backend under test, which must declare an FP8 KV cache."""
        assert attention_backend.supports_fp8_kv_cache
        return attention_backend


class TestFp8TritonMLA(MLABackendTests):
    """The MLA suite, its FP8 latent-cache case included, for the Triton MLA backend."""

    @pytest.fixture
    def backend(self) -> Any:
        """The Triton MLA backend, which must declare an FP8 latent cache."""
        _needs_e4m3()
        pytest.importorskip("triton")
        from backplane.backends.triton.mla import TritonMLABackend

        backend = TritonMLABackend()
        assert backend.supports_fp8_kv_cache
        return backend
