"""Chat templates and tokenizer files of Hugging Face folders, against transformers' tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from backplane.core.errors import ConfigError, RequestError  # noqa: E402
from backplane.models.presets import byte_tokenizer  # noqa: E402
from backplane.models.tokenizer import load_hf_tokenizer  # noqa: E402

TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m.role) }}"
    "{% endif %}\n"
    "  <|turn|>{{ m.role }}: {{ m.content | trim }}"
    "{% if m.meta is defined %} {{ m.meta | tojson }}{% endif %}\n"
    "{% if loop.index >= 4 %}{% break %}{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|turn|>assistant:{% endif %}"
    "{{ eos_token if not add_generation_prompt else '' }}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "  hi there  "}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "é <b>x</b>", "meta": {"tag": "<b>é</b>", "n": [1, 2]}},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
        {"role": "user", "content": "past the break"},
    ],
]


def _folder(root: Path, *, jinja: str | None = None, generation: dict | None = None) -> Path:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        eos_token_id=257,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(root)
    byte_tokenizer().save(str(root / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": {"__type": "AddedToken", "content": "<|eos|>", "special": True},
        "added_tokens_decoder": {
            "258": {"content": "<|turn|>", "special": True, "normalized": False}
        },
        "chat_template": TEMPLATE,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    if jinja is not None:
        (root / "chat_template.jinja").write_text(jinja)
    if generation is not None:
        (root / "generation_config.json").write_text(json.dumps(generation))
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return _folder(tmp_path_factory.mktemp("chat"))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_rendering_and_ids_match_transformers(folder, index, add_generation_prompt):
    ours = load_hf_tokenizer(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    conv = CONVERSATIONS[index]
    text = ours.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
    assert text == theirs.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    want = theirs.apply_chat_template(
        conv, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert ours.encode_chat(conv, add_generation_prompt=add_generation_prompt) == list(want)
    # the added token from tokenizer_config.json is one token, as in transformers
    assert ours.token_to_id("<|turn|>") == theirs.convert_tokens_to_ids("<|turn|>")


def test_template_exception_and_bad_messages_are_request_errors(folder):
    tok = load_hf_tokenizer(folder)
    with pytest.raises(RequestError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(RequestError, match="role"):
        tok.apply_chat_template([{"content": "x"}])
    with pytest.raises(RequestError, match="non-empty list"):
        tok.apply_chat_template([])


def test_chat_template_jinja_file_takes_precedence(tmp_path):
    path = _folder(tmp_path / "m", jinja="{% for m in messages %}[{{ m.content }}]{% endfor %}")
    ours = load_hf_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    conv = CONVERSATIONS[0]
    assert ours.apply_chat_template(conv) == theirs.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(conv) == "[  hi there  ]"


def test_invalid_template_is_a_config_error_naming_the_file(tmp_path):
    path = _folder(tmp_path / "m", jinja="{% for m in messages %}")
    with pytest.raises(ConfigError, match=r"chat_template\.jinja"):
        load_hf_tokenizer(path)


def test_generation_config_gives_sampling_defaults_and_eos(tmp_path):
    from backplane import LLM, SamplingParams

    gen = {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "eos_token_id": 258,
    }
    llm = LLM(str(_folder(tmp_path / "m", generation=gen)), device="cpu", kv_memory="2MiB")
    params = llm.default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 20)
    assert params.repetition_penalty == 1.05
    assert llm.default_sampling_params(temperature=0.0).temperature == 0.0
    assert set(llm.engine.eos_token_ids) == {257, 258}
    assert llm.tokenizer.special_tokens["eos_token"] == "<|eos|>"
    # a chat stops at the tokenizer's end of turn too; with ignore_eos it runs to the limit
    out = llm.chat(
        [{"role": "user", "content": "hi"}],
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    )[0]
    assert len(out.token_ids) == 6


@pytest.mark.parametrize("do_sample", [False, True])
def test_generation_config_penalties_are_defaults_greedy_or_not(tmp_path, do_sample):
    """repetition_penalty (and presence / frequency penalties where a file has them) change
    greedy decoding too (transformers applies them either way; vLLM reads them)."""
    from backplane import SamplingParams
    from backplane.models.loader import read_generation_config

    gen = {
        "do_sample": do_sample,
        "temperature": 0.7,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
    }
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    _, defaults = read_generation_config(tmp_path)
    assert defaults["temperature"] == (0.7 if do_sample else 0.0)
    p = SamplingParams(**defaults)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.1, 0.5, 0.25)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": do_sample}))
    assert "repetition_penalty" not in read_generation_config(tmp_path)[1]


def test_folder_without_sampling_in_generation_config_is_greedy(tmp_path):
    from backplane import LLM

    llm = LLM(
        str(_folder(tmp_path / "m", generation={"eos_token_id": [257]})),
        device="cpu",
        kv_memory="2MiB",
    )
    assert llm.default_sampling_params().temperature == 0.0
