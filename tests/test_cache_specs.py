"""Cache specs say what is paged; the engine sizes its pool from them, describing caches twice."""

from __future__ import annotations

import copy

import pytest
import torch

from backplane.core import layouts
from backplane.core.families import AttentionLayerSpec, MLALayerSpec
from backplane.core.hookspecs import FAMILIES
from backplane.core.layouts import TensorSpec, cache_footprint
from backplane.engine.engine import Engine
from backplane.engine.worker.device_worker import DeviceWorker
from backplane.models.base import CausalLM

TORCH_BACKENDS = dict.fromkeys(FAMILIES, "torch")


def make_engine(model: str, **kw) -> Engine:
    cfg = dict(
        model=model,
        device="cpu",
        max_num_seqs=4,
        max_num_tokens=32,
        page_size=4,
        num_kv_pages=None,
        kv_memory="2MiB",
        backends=TORCH_BACKENDS,
    )
    cfg.update(kw)
    return Engine(**cfg)


def test_shared_layouts_mark_what_is_paged() -> None:
    kv = layouts.paged_kv(5, 4, 2, 16, torch.bfloat16)
    latent = layouts.mla_latent(5, 4, 32, 8, torch.float32)
    assert kv.paged and latent.paged
    assert kv.page_bytes == 2 * 4 * 2 * 16 * 2 and kv.nbytes == 5 * kv.page_bytes
    assert latent.page_bytes == 4 * 40 * 4
    for state in (
        layouts.ssm_state(3, 2, 8, 4),
        layouts.conv_state(3, 12, 4, torch.float16),
        layouts.delta_state(3, 2, 8, 8),
    ):
        assert not state.paged and state.page_bytes == 0
    assert TensorSpec((3, 4), torch.float32).paged is False  # the default: not paged


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-nemotron-h", "tiny-deepseek-v3"])
def test_footprint_agrees_with_specs_of_two_page_counts(model) -> None:
    """Per-page bytes read off the flags equal the growth between two page counts."""
    engine = make_engine(model)
    kw = {"page_size": 4, "num_slots": 5, "dtype": torch.float32}
    two = engine.model.cache_specs(num_pages=2, **kw)
    nine = engine.model.cache_specs(num_pages=9, **kw)
    total = lambda specs: sum(s.nbytes for lay in specs.values() for s in lay.values())  # noqa: E731
    footprint = cache_footprint(two)
    assert footprint.page_bytes > 0
    assert total(nine) - total(two) == 7 * footprint.page_bytes
    assert footprint.total_bytes(9) == total(nine)
    grown = {(lay, n) for lay in two for n in two[lay] if two[lay][n] != nine[lay][n]}
    assert grown == set(footprint.paged)
    assert engine.kv_bytes == engine.num_pages * footprint.page_bytes
    assert engine.kv_bytes + engine.state_bytes <= 2 << 20


def test_engine_describes_its_caches_once_to_size_and_once_to_allocate(monkeypatch) -> None:
    calls: list[int] = []
    describe = CausalLM.cache_specs

    def counting(self, **kw):
        calls.append(kw["num_pages"])
        return describe(self, **kw)

    load = DeviceWorker._select_and_load

    def load_then_count(self):
        result = load(self)  # backend selection may describe caches to check its layers
        monkeypatch.setattr(CausalLM, "cache_specs", counting)
        return result

    monkeypatch.setattr(DeviceWorker, "_select_and_load", load_then_count)
    engine = make_engine("tiny-nemotron-h")
    assert calls == [2, engine.num_pages]


def test_a_cache_that_grows_with_pages_must_be_marked_paged(monkeypatch) -> None:
    def unmarked(num_pages, page_size, num_kv_heads, head_dim, dtype):
        return TensorSpec((num_pages, 2, page_size, num_kv_heads, head_dim), dtype)

    monkeypatch.setattr(layouts, "paged_kv", unmarked)
    with pytest.raises(ValueError, match="paged=True"):
        make_engine("tiny-llama")


def test_flashinfer_cache_spec_has_no_side_effects() -> None:
    from backplane.backends.flashinfer.attention import FlashInferAttentionBackend
    from backplane.backends.flashinfer.mla import FlashInferMLABackend

    cases = [
        (FlashInferAttentionBackend(), AttentionLayerSpec(0, 8, 2, 128)),
        (FlashInferMLABackend(), MLALayerSpec(0, 16, 512, 128, 64, 128, 0.1)),
    ]
    for backend, layer in cases:
        before = copy.deepcopy(vars(backend))
        spec = backend.cache_spec(layer, num_pages=7, page_size=16, dtype=torch.bfloat16)
        assert all(s.paged for s in spec.values())
        assert vars(backend) == before
