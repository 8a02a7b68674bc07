"""The conformance kit on the FlashInfer backends, at shapes FlashInfer's kernels are built for.

``tests/test_backend_<family>.py`` run every registered backend at the kit's default
(tiny) shapes; FlashInfer's kernels exist only for some head dimensions and half
precision, so this module runs the same suites with the class attributes set to
shapes FlashInfer supports (attention head dim 128, MLA latent 512 + rope 64,
Mamba2 head dim 64 / state 128, GDN head dim 128) and bfloat16.

The one-dtype kit tests run in bfloat16 (``single_dtype``); the delta kit's float32
opcheck is skipped with the reason (FlashInfer's GDN kernel takes half precision only)
and its decode graph-replay check is re-run in bfloat16.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from backplane.core.registry import get_registry
from backplane.testing.attention import AttentionBackendTests
from backplane.testing.plugin import load_backend

pytestmark = pytest.mark.gpu

_FLOAT32_ONLY = (
    "the kit runs this test in float32; FlashInfer kernels run in half precision "
    "(see test_flashinfer_gpu.py for the bfloat16 equivalent)"
)


def _backend(family: str) -> Any:
    spec = get_registry().get(family, "flashinfer")
    ok, reason = spec.availability()
    if not ok:
        pytest.skip(f"{family} backend 'flashinfer': {reason}")
    return load_backend(spec)


class _HalfPrecision:
    """CUDA and bfloat16 only (one dtype keeps the JIT-compiled kernel set small)."""

    @pytest.fixture
    def device(self) -> torch.device:
        return torch.device("cuda")

    @pytest.fixture
    def dtype(self) -> torch.dtype:
        return torch.bfloat16


class TestFlashInferAttentionKit(_HalfPrecision, AttentionBackendTests):
    """The attention suite at head dim 128 (GQA group 4 on CUDA cores, 8 on tensor cores)."""

    head_dim = 128
    num_heads = 4
    gqa_shapes = ((8, 2), (8, 1))
    single_dtype = torch.bfloat16

    @pytest.fixture
    def backend(self) -> Any:
        return _backend("attention")


try:
    from backplane.testing.mla import MLABackendTests
except ImportError:  # the kit's MLA suite is not in this checkout
    MLABackendTests = None

if MLABackendTests is not None:

    class TestFlashInferMLAKit(_HalfPrecision, MLABackendTests):
        """The MLA suite at DeepSeek's latent 512 + rope 64."""

        num_heads = 16
        kv_lora_rank = 512
        qk_nope_head_dim = 128
        qk_rope_head_dim = 64
        v_head_dim = 128
        single_dtype = torch.bfloat16

        @pytest.fixture
        def backend(self) -> Any:
            return _backend("mla")


try:
    from backplane.testing.ssm import SSMBackendTests
except ImportError:
    SSMBackendTests = None

if SSMBackendTests is not None:

    class TestFlashInferSSMKit(_HalfPrecision, SSMBackendTests):
        """The Mamba2 suite at head dim 64, state 128 (decode on FlashInfer)."""

        NHEADS = 4
        HEAD_DIM = 64
        D_STATE = 128

        @pytest.fixture
        def backend(self) -> Any:
            return _backend("ssm")


try:
    from backplane.testing.delta import DeltaBackendTests
except ImportError:
    DeltaBackendTests = None

if DeltaBackendTests is not None:

    class TestFlashInferDeltaKit(_HalfPrecision, DeltaBackendTests):
        """The gated-delta-rule suite at head dim 128 (prefill on FlashInfer, sm90)."""

        NUM_K_HEADS = 2
        K_HEAD_DIM = 128
        V_HEAD_DIM = 128

        @pytest.fixture
        def backend(self) -> Any:
            return _backend("delta")

        def test_opcheck(self, backend: Any, device: torch.device) -> None:
            pytest.skip(_FLOAT32_ONLY)

        def test_decode_cuda_graph_replay(self, backend: Any, backend_capabilities: Any) -> None:
            """The kit's decode graph-replay check, in bfloat16 (the kit's runs in float32)."""
            from backplane.testing.batches import batch_cases
            from backplane.testing.checks import check_graph_replay

            device = torch.device("cuda")
            case = batch_cases("decode")[0]
            batch = case.metadata(device)
            layer = self.layer(self.NUM_K_HEADS, True)
            inp = self.inputs(batch, case.num_slots, layer, torch.bfloat16, device, seed=13)
            out = torch.empty_like(inp["v"])

            def step() -> None:
                backend.forward(*inp.values(), layer, out=out)

            check_graph_replay(
                batch,
                {"delta": backend.plan(batch)},
                step,
                [inp["q"], inp["k"], inp["v"]],
                [inp["state"]],
                [out],
            )
