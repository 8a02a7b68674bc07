"""Multi-token-prediction layers: loading from the checkpoint layouts, and the forward.

The reference is built from transformers: a model with one decoder layer more
than the target is saved, and that extra layer becomes the MTP layer's decoder
block (stored as DeepSeek-V3 stores it, ``model.layers.{N}.*``, or as
Qwen3-Next and Qwen3.5 do, ``mtp.layers.0.*``), next to the MTP layer's own tensors drawn
here. The reference forward is float64: the norms, the concatenation and the
projections written out below, the block run by transformers' own layer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
import hf_tiny  # noqa: E402
from hf_tiny import VOCAB, hf_torch_path  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from backplane.core.errors import ConfigError  # noqa: E402
from backplane.core.forward_context import forward_context, plan_step  # noqa: E402
from backplane.core.packing import build_batch_metadata  # noqa: E402
from backplane.core.registry import get_registry  # noqa: E402
from backplane.models import load_model  # noqa: E402
from backplane.models.mtp import MultiTokenPredictor, attach_mtp  # noqa: E402
from backplane.models.presets import build_preset  # noqa: E402
from backplane.testing.plugin import load_backend  # noqa: E402

PAGE_SIZE = 4
FAMILIES = ("attention", "ssm", "mla", "delta")


def _backends() -> dict[str, Any]:
    registry = get_registry()
    return {f: load_backend(registry.get(f, "torch")) for f in FAMILIES}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    scale = (1.0 + w) if zero_centered else w
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


def _causal_mask(n: int) -> torch.Tensor:
    mask = torch.full((n, n), torch.finfo(torch.float64).min, dtype=torch.float64)
    return torch.triu(mask, diagonal=1)[None, None]


class _Checkpoint:
    """A saved target + MTP checkpoint and its float64 reference."""

    def __init__(self, arch: str, root: Path) -> None:
        self.arch = arch
        torch.manual_seed(4321)
        if arch == "deepseek_v3":
            cfg = hf_tiny.deepseek_v3()
        else:
            cfg = getattr(hf_tiny, arch)()
            cfg.layer_types = [*cfg.layer_types, "full_attention"]
        n = cfg.num_hidden_layers
        cfg.num_hidden_layers = n + 1
        cfg.initializer_range = 0.15
        cfg._attn_implementation = "eager"
        cfg._experts_implementation = "eager"
        hf = getattr(transformers, self._hf_class())(cfg).eval()
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in hf.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.2)
            for name, b in hf.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.rand(b.shape, generator=gen) * 0.05)
        full = root / "full"
        hf.save_pretrained(full)
        tensors = {}
        for f in full.glob("*.safetensors"):
            tensors.update(load_file(str(f)))
        hidden = cfg.hidden_size
        own = {
            "enorm.weight": 1 + 0.2 * torch.randn(hidden, generator=gen),
            "hnorm.weight": 1 + 0.2 * torch.randn(hidden, generator=gen),
            "eh_proj.weight": 0.15 * torch.randn(hidden, 2 * hidden, generator=gen),
            "shared_head.norm.weight": 1 + 0.2 * torch.randn(hidden, generator=gen),
            "shared_head.head.weight": 0.15 * torch.randn(VOCAB, hidden, generator=gen),
            "embed_tokens.weight": 0.15 * torch.randn(VOCAB, hidden, generator=gen),
        }
        if arch != "deepseek_v3":
            own = {
                "fc.weight": own["eh_proj.weight"],
                "pre_fc_norm_embedding.weight": 0.2 * torch.randn(hidden, generator=gen),
                "pre_fc_norm_hidden.weight": 0.2 * torch.randn(hidden, generator=gen),
                "norm.weight": 0.2 * torch.randn(hidden, generator=gen),
            }
        self.own = own
        block_prefix = f"model.layers.{n}."
        saved: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if name.startswith(block_prefix) and arch != "deepseek_v3":
                saved["mtp.layers.0." + name[len(block_prefix) :]] = t
            else:
                saved[name] = t
        prefix = block_prefix if arch == "deepseek_v3" else "mtp."
        saved.update({prefix + k: v for k, v in own.items()})
        self.path = root / "mtp"
        self.path.mkdir()
        save_file(saved, str(self.path / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((full / "config.json").read_text())
        config["num_hidden_layers"] = n
        if arch == "deepseek_v3":
            config["num_nextn_predict_layers"] = 1
        else:
            config["layer_types"] = config["layer_types"][:n]
            config["mtp_num_hidden_layers"] = 1
        (self.path / "config.json").write_text(json.dumps(config))
        self.hf = hf.double()
        self.block = hf.model.layers[n]
        self.eps = cfg.rms_norm_eps

    def _hf_class(self) -> str:
        return {
            "deepseek_v3": "DeepseekV3ForCausalLM",
            "qwen3_next": "Qwen3NextForCausalLM",
            "qwen3_5": "Qwen3_5ForCausalLM",
        }[self.arch]

    @torch.no_grad()
    def reference(
        self, ids: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over one sequence from position 0: ``(hidden out, logits)``, float64."""
        own = {k: v.double() for k, v in self.own.items()}
        h = hidden.double()
        positions = torch.arange(len(ids))
        ds = self.arch == "deepseek_v3"
        if ds:
            emb = own["embed_tokens.weight"][ids]
            emb[positions == 0] = 0.0
            x = (
                torch.cat(
                    [
                        _rms(emb, own["enorm.weight"], self.eps, False),
                        _rms(h, own["hnorm.weight"], self.eps, False),
                    ],
                    dim=-1,
                )
                @ own["eh_proj.weight"].T
            )
        else:
            emb = self.hf.model.embed_tokens.weight[ids]
            x = (
                torch.cat(
                    [
                        _rms(emb, own["pre_fc_norm_embedding.weight"], self.eps, True),
                        _rms(h, own["pre_fc_norm_hidden.weight"], self.eps, True),
                    ],
                    dim=-1,
                )
                @ own["fc.weight"].T
            )
        x = x[None]
        cos_sin = self.hf.model.rotary_emb(x, positions[None])
        with hf_torch_path(self.arch):
            out = self.block(
                x,
                attention_mask=_causal_mask(len(ids)),
                position_ids=positions[None],
                position_embeddings=cos_sin,
            )
        out = (out[0] if isinstance(out, tuple) else out)[0]
        if ds:
            logits = (
                _rms(out, own["shared_head.norm.weight"], self.eps, False)
                @ own["shared_head.head.weight"].T
            )
            return out, logits
        out = _rms(out, own["norm.weight"], self.eps, True)
        return out, out @ self.hf.lm_head.weight.T


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_next", "qwen3_5"])
def checkpoint(request, tmp_path_factory) -> _Checkpoint:
    return _Checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _run_mtp(
    mtp: MultiTokenPredictor,
    backends: dict[str, Any],
    ids: torch.Tensor,
    hidden: torch.Tensor,
    chunks: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the MTP layer over one sequence in ``chunks`` (prefill, then extends / decodes)."""
    n = len(ids)
    pages = list(range(1, 1 + -(-n // PAGE_SIZE)))[::-1]
    mtp.allocate_caches(
        num_pages=len(pages) + 1,
        page_size=PAGE_SIZE,
        num_slots=2,
        dtype=torch.float32,
        device="cpu",
    )
    outs, logits = [], []
    start = 0
    for size in chunks:
        batch = build_batch_metadata([size], [start], [pages], PAGE_SIZE)
        with torch.no_grad(), forward_context(batch, plan_step(backends, batch)):
            out = mtp(ids[start : start + size], batch.positions, hidden[start : start + size])
            outs.append(out)
            logits.append(mtp.compute_logits(out))
        start += size
    return torch.cat(outs), torch.cat(logits)


def test_mtp_layer_loads_from_the_checkpoint_and_matches_a_float64_reference(checkpoint):
    backends = _backends()
    lm = load_model(
        str(checkpoint.path), dtype="float32", device="cpu", backends=_backends(), mtp=True
    ).model
    assert isinstance(lm.mtp, MultiTokenPredictor)
    # the MTP attention caches belong to the proposer, not to the target's cache plan
    assert not any(name.startswith("mtp.") for name, _ in lm.cached_layers())
    assert list(
        lm.mtp.cache_specs(num_pages=2, page_size=PAGE_SIZE, num_slots=2, dtype=torch.float32)
    )
    gen = torch.Generator().manual_seed(3)
    n = 11
    ids = torch.randint(0, VOCAB, (n,), generator=gen)
    hidden = torch.randn(n, lm.hidden_size, generator=gen)
    want_h, want_logits = checkpoint.reference(ids, hidden)
    for chunks in ([n], [6, 3, 1, 1]):
        got_h, got_logits = _run_mtp(lm.mtp, backends, ids, hidden, chunks)
        torch.testing.assert_close(got_h.double(), want_h, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_logits.double(), want_logits, rtol=1e-4, atol=1e-4)


def test_without_mtp_the_checkpoint_mtp_tensors_are_ignored(checkpoint):
    lm = load_model(str(checkpoint.path), dtype="float32", device="cpu", backends=_backends()).model
    assert getattr(lm, "mtp", None) is None
    assert not any(name.startswith("mtp.") for name, _ in lm.named_parameters())


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-qwen3-next"])
def test_presets_with_mtp_keep_the_target_weights(preset):
    backends = _backends()
    plain = build_preset(preset, backends=backends).model
    with_mtp = build_preset(preset, backends=backends, mtp=True).model
    mtp_params = [n for n, _ in with_mtp.named_parameters() if n.startswith("mtp.")]
    assert mtp_params
    target_state = plain.state_dict()
    state = with_mtp.state_dict()
    assert set(target_state) == {k for k in state if not k.startswith("mtp.")}
    for name, t in target_state.items():
        assert torch.equal(state[name], t), name
    assert [n for n, _ in plain.cached_layers()] == [n for n, _ in with_mtp.cached_layers()]


def test_attach_mtp_refuses_a_model_without_mtp_layers():
    lm = build_preset("tiny-llama", backends=_backends()).model
    with pytest.raises(ConfigError, match="method 'ngram' or 'draft_model'"):
        attach_mtp(lm)
