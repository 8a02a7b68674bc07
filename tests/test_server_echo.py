"""Completions ``echo`` (prompt logprobs in OpenAI's legacy shape), ``max_tokens: 0``, and the
tokenizer routes (``/tokenize``, ``/detokenize``, ``/tokenizer_info``) and ``/version``.

The app runs in process over the tiny Llama preset; every number is checked
against an offline :class:`LLM` of the same preset (its prompt logprobs are
checked against transformers in ``test_prompt_logprobs.py``), every text
against its tokenizer.
"""

from __future__ import annotations

import json

import pytest

for _module in ("fastapi", "httpx"):
    pytest.importorskip(_module, reason=f"{_module} is not installed (pip install -e '.[dev]')")

from fastapi.testclient import TestClient  # noqa: E402

from backplane import LLM, SamplingParams, __version__  # noqa: E402
from backplane.models.chat import ChatTemplate  # noqa: E402

CONFIG = dict(device="cpu", max_num_seqs=4, max_num_tokens=32, page_size=4, num_kv_pages=128)
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
#: logprobs of one engine run against another (same weights, other batches)
ATOL = 1e-4


@pytest.fixture(scope="module")
def served():
    """(client, offline LLM): the app over one tiny Llama, a second one for the references."""
    from backplane.api import AsyncLLM
    from backplane.server.app import build_app

    llm = LLM("tiny-llama", **CONFIG)
    llm.tokenizer.chat_template = ChatTemplate(TEMPLATE, origin="test")
    engine = AsyncLLM(llm=llm)
    reference = LLM("tiny-llama", **CONFIG)
    reference.tokenizer.chat_template = ChatTemplate(TEMPLATE, origin="test")
    try:
        with TestClient(build_app(engine, model_name="tiny")) as client:
            yield client, reference
    finally:
        engine.shutdown()
        reference.shutdown()


def _reference(llm: LLM, ids: list[int], k: int, max_tokens: int = 1):
    """The offline output of a greedy request with prompt and sample logprobs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=k, prompt_logprobs=k)
    return llm.generate([ids], params)[0]


def _check_prompt_part(lp: dict, ids: list[int], ref, k: int) -> None:
    """The echoed prompt's logprobs against the offline prompt logprobs."""
    n = len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, n):
        want = ref.prompt_logprobs[j][ids[j]].logprob
        assert lp["token_logprobs"][j] == pytest.approx(want, abs=ATOL), j
        # the prompt token and the k most likely, each once by its text
        top_ref = {
            v.decoded_token: v.logprob
            for t, v in ref.prompt_logprobs[j].items()
            if t == ids[j] or v.rank <= k
        }
        assert lp["top_logprobs"][j] == pytest.approx(top_ref, abs=ATOL), j
    # each token by its own text, as the tokenizer spells it alone
    assert lp["tokens"][:n] == [_spelled(ref, ids, j) for j in range(n)]


def _spelled(ref, ids: list[int], j: int) -> str:
    """The text of prompt token ``j``: its offline logprob's, or for the first the tokenizer's."""
    if j > 0:
        return ref.prompt_logprobs[j][ids[j]].decoded_token
    return bytes([ids[0]]).decode("utf-8", errors="replace")  # the preset spells bytes


def test_echo_with_logprobs_covers_prompt_and_completion(served):
    client, llm = served
    ids = [72, 101, 108, 108, 111, 44, 32, 72, 105]  # "Hello, Hi"
    body = {"prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ref = _reference(llm, ids, 1)
    lp = choice["logprobs"]
    assert choice["text"] == llm.decode(ids) + ref.text
    assert len(lp["tokens"]) == len(ids) + 1
    _check_prompt_part(lp, ids, ref, 1)
    # the completion's token follows the prompt's
    gen = ref.outputs[0].token_ids[0]
    assert lp["token_logprobs"][-1] == pytest.approx(
        ref.outputs[0].logprobs[0][gen].logprob, abs=ATOL
    )
    offsets = [0]
    for s in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(s))
    assert lp["text_offset"] == offsets
    assert r.json()["usage"]["completion_tokens"] == 1


def test_max_tokens_zero_with_echo_scores_only_the_prompts(served):
    client, llm = served
    prompts = ["abc", "hello"]
    body = {"prompt": prompts, "max_tokens": 0, "logprobs": 2, "echo": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["text"] for c in data["choices"]] == prompts
    for c, p in zip(data["choices"], prompts, strict=True):
        ids = llm.encode(p)
        assert len(c["logprobs"]["tokens"]) == len(ids)
        _check_prompt_part(c["logprobs"], ids, _reference(llm, ids, 2), 2)
        assert c["finish_reason"] == "length"
    total = sum(len(llm.encode(p)) for p in prompts)
    assert data["usage"] == {"prompt_tokens": total, "completion_tokens": 0, "total_tokens": total}


def test_echo_without_logprobs_prepends_the_prompt(served):
    client, llm = served
    r = client.post(
        "/v1/completions", json={"prompt": "xyz", "max_tokens": 3, "echo": True, "temperature": 0}
    )
    choice = r.json()["choices"][0]
    ref = llm.generate(["xyz"], SamplingParams(temperature=0, max_tokens=3))[0]
    assert choice["text"] == "xyz" + ref.text and choice["logprobs"] is None


def test_max_tokens_zero_needs_echo(served):
    client, _ = served
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "echo" in err["message"]


def test_streamed_echo_sends_the_prompt_first(served):
    client, llm = served
    body = {
        "prompt": "stream me",
        "max_tokens": 4,
        "echo": True,
        "logprobs": 0,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    ref = llm.generate(["stream me"], SamplingParams(temperature=0, max_tokens=4))[0]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts[0].startswith("stream me")
    assert "".join(texts) == "stream me" + ref.text
    tokens = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == len(llm.encode("stream me")) + len(ref.outputs[0].token_ids)
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and first["text_offset"][0] == 0
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == len(ref.outputs[0].token_ids)


def test_tokenize_and_detokenize_match_the_tokenizer(served):
    client, llm = served
    tok = llm.tokenizer
    r = client.post("/tokenize", json={"prompt": "hi <|eos|>", "add_special_tokens": False})
    ids = list(tok.encode("hi <|eos|>", add_special_tokens=False).ids)
    assert r.json() == {"count": len(ids), "max_model_len": 2048, "tokens": ids}
    assert ids[-1] == tok.token_id("eos_token")  # the special token is matched whole
    messages = [{"role": "user", "content": "hey"}]
    r = client.post("/tokenize", json={"messages": messages, "return_token_strs": True})
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    want = list(tok.encode(text, add_special_tokens=False).ids)
    assert r.json()["tokens"] == want
    assert r.json()["token_strs"] == [tok.id_to_token(t) for t in want]
    r = client.post("/detokenize", json={"tokens": want})
    assert r.json() == {"prompt": tok.decode(want)} and r.json()["prompt"] == text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {}, "messages"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ],
)
def test_tokenizer_routes_refuse_bad_bodies(served, path, body, param):
    client, _ = served
    r = client.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_version_and_tokenizer_info(served):
    client, llm = served
    assert client.get("/version").json() == {"version": __version__}
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|eos|>" and info["bos_token"] == "<|bos|>"
    assert info["chat_template"] == TEMPLATE and info["model_max_length"] == 2048
