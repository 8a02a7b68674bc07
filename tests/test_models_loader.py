"""The model loader, registry and presets: formats, strictness, errors, tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backplane.core.errors import ConfigError
from backplane.core.families import AttentionBackend, DeltaBackend, MLABackend, SSMBackend
from backplane.models import (
    PRESETS,
    WeightLoadError,
    load_model,
    model_class,
    supported_architectures,
)
from backplane.models.base import ModelConfig
from backplane.models.presets import byte_tokenizer, preset_config
from backplane.models.rotary import rope_inv_freq

transformers = pytest.importorskip("transformers")


def _backends() -> dict:
    # Only cache_spec/forward touch the backend; loading needs objects of the right family.
    class A(AttentionBackend):
        def forward(self, *a, **k):
            raise AssertionError("not called")

    class M(MLABackend):
        def forward(self, *a, **k):
            raise AssertionError("not called")

    class S(SSMBackend):
        def conv(self, *a, **k):
            raise AssertionError("not called")

        def scan(self, *a, **k):
            raise AssertionError("not called")

    class D(DeltaBackend):
        def forward(self, *a, **k):
            raise AssertionError("not called")

    return {"attention": A(), "mla": M(), "ssm": S(), "delta": D()}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        eos_token_id=[2, 5],
    )
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path


def _copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _reference_state(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _checkpoint_view(lm) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names (row slices of merged parameters)."""
    return {
        name: tensor if index is None else tensor[index]
        for name, (tensor, index) in lm.weight_targets().items()
    }


def test_loads_every_tensor_with_the_requested_dtype(llama_dir):
    loaded = load_model(str(llama_dir), dtype="bfloat16", device="cpu", backends=_backends())
    lm = loaded.model
    ref = _reference_state(llama_dir)
    got = _checkpoint_view(lm)
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name].float(), t.to(torch.bfloat16).float()), name
    # q/k/v and gate/up are merged parameters holding the checkpoint's rows in order.
    params = dict(lm.named_parameters())
    assert "model.layers.0.self_attn.q_proj.weight" not in params
    pre = "model.layers.1."
    want_qkv = torch.cat([ref[f"{pre}self_attn.{p}_proj.weight"] for p in "qkv"])
    want_gate_up = torch.cat([ref[f"{pre}mlp.{p}_proj.weight"] for p in ("gate", "up")])
    qkv = params[f"{pre}self_attn.qkv_proj.weight"].float()
    gate_up = params[f"{pre}mlp.gate_up_proj.weight"].float()
    assert torch.equal(qkv, want_qkv.to(torch.bfloat16).float())
    assert torch.equal(gate_up, want_gate_up.to(torch.bfloat16).float())
    assert lm.vocab_size == 64 and lm.max_model_len == 32
    assert lm.eos_token_ids == [2, 5]
    assert lm.families == {"attention"} and not lm.has_recurrent_state
    assert loaded.tokenizer is not None
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("hi!").ids) == "hi!"


def test_sharded_checkpoint_with_index(llama_dir, tmp_path):
    ref = _reference_state(llama_dir)
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text((llama_dir / "config.json").read_text())
    names = sorted(ref)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: ref[k].contiguous() for k in keys}, str(d / fname))
        weight_map.update({k: fname for k in keys})
    # A stray file next to the shards must not be read: the index decides.
    save_file({"bogus": torch.zeros(1)}, str(d / "stray.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    lm = load_model(str(d), dtype=torch.float32, device="cpu", backends=_backends()).model
    got = _checkpoint_view(lm)
    for name, t in ref.items():
        assert torch.equal(got[name], t), name


def test_missing_shard_is_named(llama_dir, tmp_path):
    d = _copy_dir(llama_dir, tmp_path / "m")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00009-of-00009.safetensors"}})
    )
    with pytest.raises(ConfigError, match="model-00009-of-00009.safetensors"):
        load_model(str(d), dtype="float32", device="cpu", backends=_backends())


def test_missing_and_unexpected_tensors_are_listed(llama_dir, tmp_path):
    d = _copy_dir(llama_dir, tmp_path / "bad")
    state = _reference_state(llama_dir)
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.self_attn.rotary.extra"] = torch.zeros(3)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(WeightLoadError) as err:
        load_model(str(d), dtype="float32", device="cpu", backends=_backends())
    msg = str(err.value)
    assert "model.layers.1.mlp.up_proj.weight" in msg
    assert "model.layers.0.self_attn.rotary.extra" in msg


@pytest.mark.parametrize("shape", [(8, 16), (16, 12), (16,)])
def test_mis_shaped_q_proj_names_the_tensor_and_its_file(llama_dir, tmp_path, shape):
    d = _copy_dir(llama_dir, tmp_path / "q")
    state = _reference_state(llama_dir)
    name = "model.layers.1.self_attn.q_proj.weight"
    assert tuple(state[name].shape) == (16, 16)
    state[name] = torch.zeros(shape)
    # Sharded, so that the message has a file to name among several.
    (d / "model.safetensors").unlink()
    rest = {k: v for k, v in state.items() if k != name}
    save_file(rest, str(d / "model-00001-of-00002.safetensors"))
    save_file({name: state[name]}, str(d / "model-00002-of-00002.safetensors"))
    weight_map = dict.fromkeys(rest, "model-00001-of-00002.safetensors")
    weight_map[name] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(WeightLoadError) as err:
        load_model(str(d), dtype="float32", device="cpu", backends=_backends())
    msg = str(err.value)
    assert name in msg and "model-00002-of-00002.safetensors" in msg
    assert str(tuple(shape)) in msg and "(16, 16)" in msg
    assert err.value.tensor == name


def test_missing_k_proj_of_a_merged_projection_is_named(llama_dir, tmp_path):
    d = _copy_dir(llama_dir, tmp_path / "k")
    state = _reference_state(llama_dir)
    del state["model.layers.0.self_attn.k_proj.weight"]
    del state["model.layers.0.mlp.gate_proj.weight"]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(WeightLoadError) as err:
        load_model(str(d), dtype="float32", device="cpu", backends=_backends())
    msg = str(err.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg
    assert "model.layers.0.mlp.gate_proj.weight" in msg
    assert "q_proj" not in msg and "qkv_proj" not in msg


def test_shape_mismatch_is_an_error(llama_dir, tmp_path):
    d = _copy_dir(llama_dir, tmp_path / "shape")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 20
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightLoadError, match="mlp"):
        load_model(str(d), dtype="float32", device="cpu", backends=_backends())


def test_hub_id_asks_for_a_local_path():
    with pytest.raises(ConfigError, match="local path"):
        load_model("meta-llama/Llama-3-8B", dtype="float32", device="cpu", backends=_backends())


def test_unknown_name_lists_presets(tmp_path):
    with pytest.raises(ConfigError, match="tiny-llama"):
        load_model(str(tmp_path / "nope"), dtype="float32", device="cpu", backends=_backends())


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="safetensors"):
        load_model(str(tmp_path), dtype="float32", device="cpu", backends=_backends())


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ConfigError) as err:
        model_class(["GPT2LMHeadModel"])
    for name in supported_architectures():
        assert name in str(err.value)
    assert "GPT2LMHeadModel" in str(err.value)


def test_missing_backend_is_a_clear_error(llama_dir):
    with pytest.raises(ConfigError, match="attention"):
        load_model(str(llama_dir), dtype="float32", device="cpu", backends={})


def test_tied_embeddings_share_the_input_embedding(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=48,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=True,
    )
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), dtype="float32", device="cpu", backends=_backends()).model
    assert not hasattr(lm, "lm_head")
    h = torch.randn(3, 16)
    assert torch.allclose(lm.compute_logits(h), hf.lm_head(h), atol=1e-6)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_reproducible_and_consistent(name):
    a = load_model(name, dtype="float32", device="cpu", backends=_backends())
    b = load_model(name, dtype="float32", device="cpu", backends=_backends())
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
        assert torch.isfinite(sa[k]).all(), k
    cfg = preset_config(name)
    assert type(a.model).__name__ == cfg.architecture
    assert a.model.vocab_size >= 258 and 257 in a.model.eos_token_ids
    ids = a.tokenizer.encode("backplane").ids
    assert ids == list(b"backplane")
    specs = a.model.cache_specs(num_pages=3, page_size=4, num_slots=2, dtype=torch.float32)
    assert specs and all(specs.values())


def test_rope_scalings_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = [
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ]
    for params in cases:
        cfg = transformers.LlamaConfig(
            hidden_size=64,
            num_attention_heads=2,
            head_dim=32,
            max_position_embeddings=512,
            rope_parameters=dict(params),
        )
        want, want_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
        got, got_factor = rope_inv_freq(32, params, 512)
        assert torch.allclose(got, want.float(), rtol=1e-6, atol=0), params["rope_type"]
        assert got_factor == pytest.approx(want_factor), params["rope_type"]


def test_legacy_rope_scaling_form_is_accepted():
    from backplane.models.rotary import rope_parameters

    cfg = ModelConfig(
        {
            "rope_theta": 1000.0,
            "rope_scaling": {"type": "linear", "factor": 2.0},
            "partial_rotary_factor": 0.5,
        }
    )
    assert rope_parameters(cfg) == {
        "rope_type": "linear",
        "factor": 2.0,
        "rope_theta": 1000.0,
        "partial_rotary_factor": 0.5,
    }


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_run_a_mixed_step_with_the_torch_backends(name):
    from backplane.core.forward_context import forward_context, plan_step
    from backplane.core.hookspecs import FAMILIES
    from backplane.core.packing import build_batch_metadata
    from backplane.engine.selection import load_backend, select_backend

    cfg = preset_config(name)
    backends = {f: load_backend(select_backend(f, "torch")) for f in FAMILIES}
    loaded = load_model(name, dtype="float32", device="cpu", backends=backends)
    lm = loaded.model
    lm.allocate_caches(num_pages=8, page_size=4, num_slots=4, dtype=torch.float32, device="cpu")
    prompts = [loaded.tokenizer.encode(t).ids for t in ("hello", "hi")]
    batch = build_batch_metadata([len(p) for p in prompts], [0, 0], [[1, 2], [3, 4]], 4)
    ids = torch.tensor([t for p in prompts for t in p])
    with torch.no_grad(), forward_context(batch, plan_step(backends, batch)):
        hidden = lm(ids, batch.positions)
        logits = lm.compute_logits(hidden[torch.from_numpy(batch.host.last_token_indices)])
    assert logits.shape == (2, cfg["vocab_size"])
    assert torch.isfinite(logits).all()
    # Different prompts give different next-token distributions.
    assert not torch.allclose(logits[0], logits[1])
