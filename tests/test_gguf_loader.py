"""GGUF files written from tiny transformers models: every weight, generation, and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import gguf  # noqa: E402
from gguf_helpers import write_gguf  # noqa: E402
from test_models_loader import _backends  # noqa: E402

from backplane.core.errors import ConfigError  # noqa: E402
from backplane.models import load_model  # noqa: E402


def _perturb_norms(model) -> None:
    # norms initialise to one; make them distinct so a misplaced norm shows
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)


def tiny_llama(seed: int = 0, **overrides):
    """A two-layer Llama with perturbed norms; ``overrides`` change its config."""
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **overrides}))
    model.eval()
    _perturb_norms(model)
    return model


def tiny_qwen3():
    torch.manual_seed(1)
    cfg = transformers.Qwen3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    _perturb_norms(model)
    return model


MODELS = {"llama": tiny_llama, "qwen3": tiny_qwen3}


@pytest.fixture(scope="module", params=sorted(MODELS))
def written(request, tmp_path_factory):
    arch = request.param
    model = MODELS[arch]()
    path = write_gguf(model, tmp_path_factory.mktemp(arch) / f"{arch}.gguf", arch)
    return arch, model, path


def _load(path):
    return load_model(path, dtype=torch.float32, device="cpu", backends=_backends(), progress=False)


def test_every_weight_equals_the_transformers_model(written):
    arch, model, path = written
    loaded = _load(path)
    lm = loaded.model
    targets = lm.weight_targets()
    state = model.state_dict()
    checked = 0
    for name, want in state.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        dest, index = targets[lm.checkpoint_to_module_name(name)]
        got = dest if index is None else dest[index]
        assert torch.equal(got, want), name
        checked += 1
    assert checked == len(targets)
    assert loaded.config.architecture == type(model).__name__
    assert lm.tie_word_embeddings == model.config.tie_word_embeddings


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([out])).logits[0, -1]
            out.append(int(logits.argmax()))
    return out[len(ids) :]


def test_greedy_generation_matches_transformers(written):
    from backplane import LLM, SamplingParams

    arch, model, path = written
    llm = LLM(str(path), device="cpu", dtype="float32", kv_memory="4MiB", max_num_seqs=4)
    prompts = [[5, 17, 33, 2, 8], [60, 61, 62]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == _hf_greedy(model, prompt, 8), arch


def test_folder_with_one_gguf_loads_and_two_are_refused(written, tmp_path):
    arch, model, path = written
    folder = tmp_path / "one"
    folder.mkdir()
    (folder / path.name).symlink_to(path)
    assert _load(folder).config.architecture == type(model).__name__
    (folder / "other.gguf").symlink_to(path)
    with pytest.raises(ConfigError, match="holds 2 GGUF files"):
        _load(folder)


# -- errors --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_model():
    return tiny_llama()


def test_truncated_file_is_named(llama_model, tmp_path):
    path = write_gguf(llama_model, tmp_path / "t.gguf", "llama")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"t\.gguf.*truncated"):
        _load(path)


@pytest.mark.parametrize(
    ("architecture", "match"),
    [
        ("gemma3", r"general\.architecture 'gemma3' is not supported.*llama, qwen3"),
        ("deepseek2", r"'deepseek2' is not loaded from GGUF.*DeepseekV3ForCausalLM"),
    ],
)
def test_unknown_architecture_is_named(llama_model, tmp_path, architecture, match):
    path = write_gguf(llama_model, tmp_path / "a.gguf", "llama", override_architecture=architecture)
    with pytest.raises(ConfigError, match=match):
        _load(path)


def test_missing_metadata_key_is_named(llama_model, tmp_path):
    path = write_gguf(llama_model, tmp_path / "m.gguf", "llama", skip_metadata=("block_count",))
    with pytest.raises(ConfigError, match=r"m\.gguf.*lacks 'llama\.block_count'"):
        _load(path)


def test_shape_mismatch_names_file_and_tensor(llama_model, tmp_path):
    path = write_gguf(
        llama_model,
        tmp_path / "s.gguf",
        "llama",
        extra_tensors={"blk.0.attn_norm.weight": np.ones(7, dtype=np.float32)},
    )
    with pytest.raises(ConfigError, match=r"s\.gguf: tensor 'blk\.0\.attn_norm\.weight'.*\(7,\)"):
        _load(path)


def test_unsupported_tensor_type_is_named(llama_model, tmp_path):
    q2k = np.zeros((1, 84), dtype=np.uint8)  # one Q2_K block
    path = tmp_path / "q.gguf"
    write_gguf(llama_model, path, "llama")
    writer = gguf.GGUFWriter(str(tmp_path / "q2.gguf"), "llama")
    reader = gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        if key.startswith("llama.") or key.startswith("tokenizer."):
            value = field.contents()
            kind = "add_float32" if isinstance(value, float) else "add_uint32"
            getattr(writer, kind)(key, value)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.add_tensor("extra.weight", q2k, raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=r"q2\.gguf: tensor 'extra\.weight' is stored as Q2_K"):
        _load(tmp_path / "q2.gguf")


def test_quantised_file_loads_as_gguf_dequantises_it(llama_model, tmp_path):
    """Q8_0 weights: the model holds exactly what gguf's reference dequantisation gives."""
    path = write_gguf(
        llama_model, tmp_path / "q8.gguf", "llama", tensor_type=gguf.GGMLQuantizationType.Q8_0
    )
    lm = _load(path).model
    targets = lm.weight_targets()
    from backplane.models.gguf.weights import hf_name, unpermute_rows

    cfg = llama_model.config
    for t in gguf.GGUFReader(str(path)).tensors:
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        want = want.reshape(tuple(reversed(t.shape.tolist())))
        if ".attn_q." in t.name or ".attn_k." in t.name:
            heads = cfg.num_attention_heads if ".attn_q." in t.name else cfg.num_key_value_heads
            want = unpermute_rows(want, heads)
        dest, _ = targets[hf_name(t.name)]
        if dest.dtype == torch.uint8:  # a projection kept quantised: its blocks hold the values
            from backplane.models.gguf.dequant import dequantize

            dest = dequantize(dest.reshape(-1), int(t.tensor_type), tuple(want.shape))
        assert torch.equal(dest, want), t.name


def _llama3_scaled(factor_rope: dict) -> tuple:
    """A tiny Llama with Llama 3.1's rope scaling, and the rope_freqs llama.cpp writes for it."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # peaked logits (a wide initialisation), so positions matter
    model = tiny_llama(3, attention_bias=False, rope_parameters=factor_rope, initializer_range=0.15)
    cfg = model.config
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    default = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    # llama.cpp's converter stores the divisor of each default frequency
    return model, (default / scaled).numpy().astype(np.float32)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_rope_freqs_tensor_gives_llama3_scaling(tmp_path):
    from backplane import LLM, SamplingParams

    model, factors = _llama3_scaled(LLAMA3_ROPE)
    assert (factors > 1.01).any() and (factors == 1.0).any()  # scaled, smoothed and kept pairs
    path = write_gguf(
        model, tmp_path / "l31.gguf", "llama", extra_tensors={"rope_freqs.weight": factors}
    )
    loaded = _load(path)
    assert loaded.config["rope_parameters"]["rope_type"] == "freq_factors"
    assert "rope_freqs.weight" not in dict(loaded.model.named_parameters())
    llm = LLM(str(path), device="cpu", dtype="float32", kv_memory="4MiB", max_num_seqs=2)
    prompt = [
        int(t) for t in torch.randint(0, 96, (60,), generator=torch.Generator().manual_seed(4))
    ]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    ours = torch.tensor([out.prompt_logprobs[j][prompt[j]].logprob for j in range(1, len(prompt))])

    def reference(m) -> torch.Tensor:
        with torch.no_grad():
            logp = torch.log_softmax(m(torch.tensor([prompt])).logits[0].double(), -1)
        return logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]

    want = reference(model)
    torch.testing.assert_close(ours.double(), want, rtol=0, atol=2e-4)
    # the scaling matters for this model: the default rope gives other logprobs
    plain = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{**model.config.to_dict(), "rope_parameters": None})
    ).eval()
    assert plain.config.rope_parameters["rope_type"] == "default"
    plain.load_state_dict(model.state_dict())
    assert (reference(plain) - want).abs().max() > 1e-2


def test_rope_freqs_of_the_wrong_length_is_refused(tmp_path):
    model, factors = _llama3_scaled(LLAMA3_ROPE)
    bad = write_gguf(
        model, tmp_path / "bad.gguf", "llama", extra_tensors={"rope_freqs.weight": factors[:-1]}
    )
    with pytest.raises(ConfigError, match="freq_factors has 7 entries"):
        _load(bad)
