"""One validation rule for HTTP and Python: the server refuses what ``SamplingParams`` and the
engine refuse, with the same message, as OpenAI-style JSON 400s (never a 500)."""

from __future__ import annotations

import json
import re

import pytest

for _module in ("fastapi", "httpx"):
    pytest.importorskip(_module, reason=f"{_module} is not installed (pip install -e '.[dev]')")

from fastapi.testclient import TestClient  # noqa: E402

from backplane.core.errors import InvalidFieldError, RequestError  # noqa: E402
from backplane.engine.sampling import SamplingParams  # noqa: E402
from backplane.models.chat import ChatTemplate, check_messages, check_template_kwargs  # noqa: E402

CONFIG = dict(device="cpu", max_num_seqs=4, max_num_tokens=32, page_size=4, num_kv_pages=128)
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def served():
    """A tiny model behind the app (its tokenizer given a chat template); yields (client, llm, async engine)."""
    from backplane import LLM
    from backplane.api import AsyncLLM
    from backplane.server.app import build_app

    llm = LLM("tiny-llama", **CONFIG)
    llm.tokenizer.chat_template = ChatTemplate(TEMPLATE, origin="test")
    engine = AsyncLLM(llm=llm)
    try:
        with TestClient(build_app(engine, model_name="tiny")) as client:
            yield client, llm, engine
    finally:
        engine.shutdown()


def _post(client, path: str, body: dict):
    # json.dumps writes a lone surrogate as the escape "\ud800", as a client's JSON would
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    return r.status_code, r.json()


def _error(status: int, body: dict) -> dict:
    assert status == 400, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


def _python_message(**fields) -> str:
    with pytest.raises(InvalidFieldError) as info:
        SamplingParams(**fields)
    return str(info.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "10"),
        ("max_tokens", True),
        ("max_tokens", 2.0),
        ("temperature", "0.5"),
        ("temperature", False),
        ("temperature", 1e39),
        ("top_p", 1e39),
        ("repetition_penalty", 1e39),
        ("repetition_penalty", 1e-39),
        ("presence_penalty", "1"),
        ("top_k", True),
        ("seed", "7"),
        ("n", "2"),
        ("min_tokens", True),
        ("stop_token_ids", [True, False]),
        ("stop_token_ids", ["5"]),
        ("stop", 5),
        ("ignore_eos", 1),
        ("include_stop_str_in_output", "yes"),
    ],
)
def test_http_refuses_what_python_refuses_with_the_same_message(served, field, value):
    client, *_ = served
    want = _python_message(**{field: value})
    for path, base in [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", CHAT),
    ]:
        err = _error(*_post(client, path, {**base, field: value}))
        assert err["message"] == want and err["param"] == field


def test_chat_limit_and_top_logprobs_are_refused_under_their_own_names(served):
    client, *_ = served
    err = _error(*_post(client, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}))
    assert err["param"] == "max_completion_tokens"
    assert err["message"] == _python_message(max_tokens=0)
    body = {**CHAT, "logprobs": True, "top_logprobs": "3"}
    err = _error(*_post(client, "/v1/chat/completions", body))
    assert err["param"] == "top_logprobs" and err["message"] == _python_message(logprobs="3")


def test_completion_logprobs_follow_the_table(served):
    client, *_ = served
    body = {"prompt": "hi", "max_tokens": 2, "logprobs": True}
    err = _error(*_post(client, "/v1/completions", body))
    assert err["param"] == "logprobs" and err["message"] == _python_message(logprobs=True)


@pytest.mark.parametrize("prompt", [[True, False], [1, "2"], [1.0, 2.0], [[3, True]]])
def test_prompt_token_ids_follow_the_engines_rule(served, prompt):
    client, llm, _ = served
    err = _error(*_post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 2}))
    assert err["param"] == "prompt"
    ids = prompt[0] if isinstance(prompt[0], list) else prompt
    with pytest.raises(RequestError) as info:
        llm.generate([ids], SamplingParams(max_tokens=2))
    # the same words after the request id each door names
    assert _after_id(err["message"]) == _after_id(str(info.value))
    assert "not an integer" in err["message"]


def _after_id(message: str) -> str:
    return re.sub(r"^.*?request '[^']*': ", "", message)


@pytest.mark.parametrize(
    "prompt", [{"text": "hi"}, 5, [], [[]], ["a", [1]], None], ids=lambda p: repr(p)
)
def test_prompt_of_no_accepted_form_is_a_400(served, prompt):
    client, *_ = served
    err = _error(*_post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 2}))
    assert err["param"] == "prompt"


def test_valid_requests_still_run(served):
    client, *_ = served
    status, body = _post(
        client,
        "/v1/completions",
        {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 1e30, "min_tokens": 2, "seed": 1},
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    status, body = _post(client, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2})
    assert status == 200 and len(body["choices"]) == 2
    status, body = _post(client, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


BAD = "a\ud800b"
SURROGATES = [
    ("/v1/completions", {"prompt": BAD}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", BAD]}, "prompt"),
    ("/v1/completions", {"prompt": BAD, "stream": True}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": [BAD]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "user": BAD}, "user"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BAD}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": BAD, "content": "x"}]}, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": BAD}]}]},
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": BAD}], "stream": True},
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x", "name": BAD}]},
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"v": BAD}},
        "chat_template_kwargs",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATES)
def test_lone_surrogates_are_json_400s_naming_the_field(served, path, body, param):
    client, *_ = served
    err = _error(*_post(client, path, {"max_tokens": 2, **body}))
    assert err["param"] == param and "not UTF-8 text" in err["message"]


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt"])
def test_reserved_template_kwargs_are_refused_by_both_doors(served, key):
    client, llm, engine = served
    body = {**CHAT, "chat_template_kwargs": {key: True, "other": 1}}
    err = _error(*_post(client, "/v1/chat/completions", body))
    assert err["param"] == "chat_template_kwargs" and key in err["message"]
    assert "sets itself" in err["message"]
    with pytest.raises(InvalidFieldError, match=key) as info:
        llm.chat(CHAT["messages"], SamplingParams(max_tokens=2), chat_template_kwargs={key: 1})
    assert info.value.field == "chat_template_kwargs"
    with pytest.raises(InvalidFieldError, match=key) as info:
        engine.render_chat(CHAT["messages"], chat_template_kwargs={key: 1})
    assert info.value.field == "chat_template_kwargs"


def test_chat_checks_refuse_bad_text_and_reserved_names():
    with pytest.raises(InvalidFieldError, match=r"messages\[1\]\.role") as info:
        check_messages([{"role": "user", "content": "x"}, {"role": BAD, "content": "y"}])
    assert info.value.field == "messages"
    with pytest.raises(InvalidFieldError, match="messages"):
        check_template_kwargs({"messages": []})
    with pytest.raises(InvalidFieldError, match=r"chat_template_kwargs\.tools\[0\]"):
        check_template_kwargs({"tools": [BAD]})
    assert check_template_kwargs(None) == {} and check_template_kwargs({"a": 1}) == {"a": 1}
    with pytest.raises(InvalidFieldError, match="chat_template_kwargs"):
        ChatTemplate(TEMPLATE).render([{"role": "user", "content": "x"}], tools=[BAD])


@pytest.mark.parametrize("prompt", [BAD, ["ok", BAD]])
def test_python_prompts_that_are_not_utf8_are_request_errors(served, prompt):
    _, llm, _ = served
    with pytest.raises(InvalidFieldError, match="not UTF-8 text") as info:
        llm.generate(prompt, SamplingParams(max_tokens=2))
    assert info.value.field == "prompt"
