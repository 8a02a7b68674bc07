"""An FP8 (e4m3) latent cache for MLA layers: a whole model against its float32 cache, refusals.

The ``tiny-deepseek-v3`` preset (MLA layers) runs teacher-forced, a prefill
and then one-token decodes, once with a float32 latent cache and once with
``use_fp8_kv_cache`` (torch MLA backend); the logits must stay close (the
bounds below, about 1.5x what was measured) yet differ (the cache really was
rounded), and the cache must hold the latents divided by the layer's scale.
"""

from __future__ import annotations

import pytest
import torch

from backplane.backends.torch.attention import TorchAttentionBackend
from backplane.backends.torch.delta import TorchDeltaBackend
from backplane.backends.torch.mla import TorchMLABackend
from backplane.backends.torch.ssm import TorchSSMBackend
from backplane.core.errors import ConfigError
from backplane.core.families import MLABackend
from backplane.core.forward_context import forward_context, plan_step
from backplane.core.packing import build_batch_metadata
from backplane.models import load_model
from backplane.models.base import CausalLM
from backplane.models.mixers import MLAMixer
from backplane.models.quant.kv_cache import use_fp8_kv_cache

PRESET = "tiny-deepseek-v3"
PAGE_SIZE = 16
PROMPT, DECODE = 20, 12
FP8 = torch.float8_e4m3fn
#: Logit errors in units of the reference logits' standard deviation over 32
#: teacher-forced positions. Measured (kv_scale 1.0 and 0.25): mean 0.019,
#: largest 0.48, next-token agreement 32/32.
MAX_MEAN_LOGIT_ERROR = 0.03
MAX_LOGIT_ERROR = 0.7
MIN_AGREEMENT = 0.9


def _backends() -> dict:
    return {
        "attention": TorchAttentionBackend(),
        "mla": TorchMLABackend(),
        "ssm": TorchSSMBackend(),
        "delta": TorchDeltaBackend(),
    }


def _logits(lm: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits of ``ids``: a prefill of :data:`PROMPT` tokens, then one-token decodes."""
    lm.allocate_caches(
        num_pages=5, page_size=PAGE_SIZE, num_slots=2, dtype=torch.float32, device="cpu"
    )
    table = torch.arange(1, 5).numpy()
    backends = _backends()
    out, done = [], 0
    for n in [PROMPT] + [1] * DECODE:
        batch = build_batch_metadata([n], [done], [table], PAGE_SIZE, state_slots=[1], device="cpu")
        with torch.no_grad(), forward_context(batch, plan_step(backends, batch)):
            hidden = lm(ids[done : done + n], batch.positions)
            out.append(lm.compute_logits(hidden[:n]).clone())
        done += n
    return torch.cat(out)


def _load() -> CausalLM:
    return load_model(PRESET, dtype="float32", device="cpu", backends=_backends()).model


def _mla_layers(lm: CausalLM) -> list[MLAMixer]:
    return [m for m in lm.modules() if isinstance(m, MLAMixer)]


@pytest.fixture(scope="module")
def reference() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, the float32-cache logits and the first MLA layer's float32 latent cache."""
    lm = _load()
    ids = torch.randint(
        0, lm.vocab_size, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(3)
    )
    logits = _logits(lm, ids)
    return ids, logits, _mla_layers(lm)[0].cache("latent_cache").clone()


@pytest.mark.parametrize("kv_scale", [1.0, 0.25])
def test_fp8_latent_cache_against_the_float_cache(reference, kv_scale) -> None:
    ids, ref, ref_cache = reference
    lm = _load()
    mla = _mla_layers(lm)
    assert mla, f"{PRESET} has no MLA layers"
    ids_of = {m.spec.layer_id for m in mla}
    assert use_fp8_kv_cache(lm, dict.fromkeys(ids_of, (kv_scale, 1.0))) >= len(mla)
    assert all(m.spec.kv_scale == kv_scale for m in mla)
    specs = lm.cache_specs(num_pages=3, page_size=PAGE_SIZE, num_slots=2, dtype=torch.float32)
    latent_specs = [layer["latent_cache"] for layer in specs.values() if "latent_cache" in layer]
    assert latent_specs and {s.dtype for s in latent_specs} == {FP8}
    got = _logits(lm, ids)
    err = (got - ref).abs() / ref.std()
    assert 0 < err.mean().item() < MAX_MEAN_LOGIT_ERROR, err.mean().item()
    assert err.max().item() < MAX_LOGIT_ERROR, err.max().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= MIN_AGREEMENT
    # every written row is the float row over kv_scale rounded to e4m3 (the
    # same step's inputs: the first layer sees the same hidden states)
    cache = mla[0].cache("latent_cache")
    limit = torch.finfo(FP8).max
    want = (ref_cache.double() / kv_scale).clamp(-limit, limit).to(FP8)
    rows = cache[1:3].view(torch.uint8)  # the prompt's pages
    assert torch.equal(rows, want[1:3].view(torch.uint8))


def test_fp8_latent_cache_is_refused_by_an_mla_backend_without_it() -> None:
    class NoFp8(MLABackend):
        name = "plain-mla"

        def forward(self, *args, **kwargs):
            raise AssertionError("not called")

    backends = dict(_backends(), mla=NoFp8())
    lm = load_model(PRESET, dtype="float32", device="cpu", backends=backends).model
    with pytest.raises(ConfigError, match="'plain-mla' mla backend.*torch mla backend"):
        use_fp8_kv_cache(lm)
