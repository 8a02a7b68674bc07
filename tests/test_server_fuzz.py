"""Fuzzing the request schemas of ``/v1/completions`` and ``/v1/chat/completions``.

Every field takes either a plausible value or any JSON value (wrong types, huge
numbers, NaN, lone surrogates, nesting); whatever the body, the server answers
with JSON and never a 5xx, and every refusal has OpenAI's error shape.
"""

from __future__ import annotations

import json

import pytest

for _module in ("fastapi", "httpx", "hypothesis"):
    pytest.importorskip(_module, reason=f"{_module} is not installed (pip install -e '.[dev]')")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from backplane.engine.sampling import FLOAT32_MAX  # noqa: E402
from backplane.models.chat import ChatTemplate  # noqa: E402

CONFIG = dict(device="cpu", max_num_seqs=4, max_num_tokens=32, page_size=4, num_kv_pages=128)
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"

#: Bounded examples: the whole file runs in well under a minute on two cores.
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

_surrogates = st.sampled_from(["\ud800", "a\udfffb", "\udc00\ud800"])
_text = st.text(max_size=8) | _surrogates
# small integers only: a valid max_tokens or n from here keeps generation short
_ints = st.integers(-3, 10) | st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, 10**30])
_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e39, -1e39, 1e-39])
_scalars = st.none() | st.booleans() | _ints | _floats | _text
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6,
)


_clean = st.text(st.characters(codec="utf-8"), min_size=1, max_size=8)

#: Valid values of each optional field, mostly (the other arm sends any JSON at all).
_SAMPLING = {
    "model": st.just("tiny"),
    "max_tokens": st.integers(1, 3),
    "temperature": st.floats(0, 2) | st.sampled_from([0, 1e30, FLOAT32_MAX]),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 320),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": _clean | st.lists(_clean, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 319), max_size=3),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 3),
    "min_tokens": st.integers(0, 1),
    "include_stop_str_in_output": st.booleans(),
    "user": _clean,
}
_COMPLETION_ONLY = {
    "logprobs": st.integers(0, 5),
    "prompt_logprobs": st.integers(0, 3),
    "echo": st.just(False),
    "best_of": st.just(1),
}
_CHAT_ONLY = {
    "max_completion_tokens": st.integers(1, 3),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "add_generation_prompt": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["x", "tools"]), _json, max_size=2),
}
_PROMPT = (
    _clean
    | st.lists(st.integers(0, 319), min_size=1, max_size=5)
    | st.lists(_clean, min_size=1, max_size=3)
)
_part = st.fixed_dictionaries({"type": st.just("text"), "text": _clean})
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": _clean | st.none() | st.lists(_part, max_size=2),
    },
    optional={"name": _clean},
)
_MESSAGES = st.lists(_message, min_size=1, max_size=3)


#: Values known to have broken a server: beyond float32, numbers as strings, booleans as
#: numbers, lone surrogates where text goes, template variables the renderer sets itself.
_EDGES = st.sampled_from(
    [
        "\ud800",
        ["ok", "a\udfffb"],
        1e39,
        -1e39,
        1e-39,
        float("nan"),
        float("inf"),
        "10",
        True,
        [True, False],
        [1, "2"],
        2**64,
        [],
        {},
        [{"role": "\ud800", "content": "x"}],
        [{"role": "user", "content": "\ud800"}],
        [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}],
        {"messages": []},
        {"add_generation_prompt": False},
        {"x": "\ud800"},
    ]
)


def _bodies(required: dict, optional: dict) -> st.SearchStrategy:
    """Bodies of three kinds: valid values; valid values but one field (or an unknown one)
    set to an edge value or any JSON value; and any JSON value in every field."""
    valid = st.fixed_dictionaries(required, optional=optional)
    keys = sorted(required) + sorted(optional) + ["\ud800", "unknown"]
    one_bad = st.tuples(valid, st.sampled_from(keys), _EDGES | _json).map(
        lambda t: {**t[0], t[1]: t[2]}
    )
    anything = st.fixed_dictionaries(
        {k: v | _json for k, v in required.items()},
        optional={**{k: v | _json for k, v in optional.items()}, "\ud800": _json},
    )
    return valid | one_bad | one_bad | anything


@pytest.fixture(scope="module")
def client():
    from backplane import LLM
    from backplane.api import AsyncLLM
    from backplane.server.app import build_app

    llm = LLM("tiny-llama", **CONFIG)
    llm.tokenizer.chat_template = ChatTemplate(TEMPLATE, origin="test")
    engine = AsyncLLM(llm=llm)
    try:
        with TestClient(build_app(engine, model_name="tiny")) as c:
            yield c
    finally:
        engine.shutdown()


def _check(client, path: str, body: dict) -> None:
    # allow_nan: Python's json writes NaN and Infinity, and the server's parser reads them
    payload = json.dumps(body, allow_nan=True)
    r = client.post(path, content=payload, headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:500], payload[:500])
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.status_code == 200
        for line in r.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event or set(event["error"]) >= {"message", "type"}
        return
    data = r.json()
    if r.status_code >= 400:
        assert set(data) == {"error"}, data
        assert set(data["error"]) == {"message", "type", "param", "code"}, data
        assert isinstance(data["error"]["message"], str) and data["error"]["message"]
    else:
        assert r.status_code == 200 and "choices" in data, data


@FUZZ
@given(body=_bodies({"prompt": _PROMPT}, {**_SAMPLING, **_COMPLETION_ONLY}))
def test_completions_never_answer_5xx(client, body):
    _check(client, "/v1/completions", body)


@FUZZ
@given(body=_bodies({"messages": _MESSAGES}, {**_SAMPLING, **_CHAT_ONLY}))
def test_chat_completions_never_answer_5xx(client, body):
    _check(client, "/v1/chat/completions", body)
