"""Tool calls and reasoning through the server, driven by the ``openai`` client.

The app runs in process over SmolLM2-135M-Instruct. The model is too small to
call tools by itself, so its output is steered with structured output: forced
calls (``tool_choice`` ``required`` or named) must come out valid for the
tools' schemas, and a regular expression makes it write Hermes markup or a
``<think>`` block, which the server must turn into ``tool_calls`` and
``reasoning_content``, streamed or not.
"""

from __future__ import annotations

import json
import re

import pytest

for _module in ("fastapi", "httpx", "openai", "xgrammar", "jsonschema"):
    pytest.importorskip(_module, reason=f"{_module} is not installed (pip install -e '.[dev]')")

import jsonschema  # noqa: E402
import openai  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 20}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

#: Hermes markup after some text: what a model that calls a tool writes.
HERMES_OUTPUT = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "unit": "celsius"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def app():
    from backplane import LLM
    from backplane.api import AsyncLLM
    from backplane.server.app import build_app

    engine = AsyncLLM(llm=LLM("smollm2", device="cpu", max_num_seqs=8))
    try:
        yield build_app(engine, model_name="smollm2")
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app) as http:
        yield openai.OpenAI(
            base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
        )


def _regex_of(text: str) -> str:
    return re.escape(text).replace("\\\n", "\\n")


def _exact(text: str) -> dict:
    """Body fields that make the model write exactly ``text``."""
    return {"structured_outputs": {"regex": _regex_of(text)}}


def _assemble(chunks) -> tuple[dict, str | None]:
    """A streamed choice put together as a client does: content, reasoning, calls."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id.startswith("call_") and tc.function.name
                    calls[tc.index] = {"name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and not tc.function.name
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    message = {
        "content": content or None,
        "reasoning_content": reasoning or None,
        "tool_calls": [calls[i] for i in sorted(calls)],
    }
    return message, finish


def _message(choice) -> dict:
    calls = choice.message.tool_calls or []
    return {
        "content": choice.message.content,
        "reasoning_content": getattr(choice.message, "reasoning_content", None),
        "tool_calls": [{"name": c.function.name, "arguments": c.function.arguments} for c in calls],
    }


def _check_valid(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice_gives_a_valid_call(client):
    r = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=80,
    )
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        _check_valid(choice.message.tool_calls)
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_gives_valid_calls(client, parallel):
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Weather in Oslo and the time in Tokyo?"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=0.0,
        max_tokens=150,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    _check_valid(choice.message.tool_calls)
    if not parallel:
        assert len(choice.message.tool_calls) == 1


def test_forced_call_streams_as_it_answers(client):
    body = dict(
        model="smollm2",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0.0,
        max_tokens=60,
    )
    whole = client.chat.completions.create(**body).choices[0]
    streamed, finish = _assemble(client.chat.completions.create(**body, stream=True))
    assert streamed == _message(whole) and finish == whole.finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_hermes_markup(client, stream):
    body = dict(model="smollm2", messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=80)
    r = client.chat.completions.create(**body, extra_body=_exact(HERMES_OUTPUT), stream=stream)
    message, finish = (
        _assemble(r) if stream else (_message(r.choices[0]), r.choices[0].finish_reason)
    )
    assert finish == "tool_calls"
    assert message["content"] == "Let me look."
    assert [(c["name"], json.loads(c["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]


def test_tool_choice_none_leaves_the_markup_in_the_content(client):
    r = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=TOOLS,
        tool_choice="none",
        temperature=0.0,
        max_tokens=80,
        extra_body=_exact(HERMES_OUTPUT),
    )
    choice = r.choices[0]
    assert choice.message.content == HERMES_OUTPUT and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_without_tools_the_markup_is_content(client):
    r = client.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=80, extra_body=_exact(HERMES_OUTPUT)
    )
    assert r.choices[0].message.content == HERMES_OUTPUT


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content_when_asked(client, stream):
    output = "<think>\nParis is in France.\n</think>\n\nIt is sunny."
    body = dict(model="smollm2", messages=ASK, temperature=0.0, max_tokens=60, stream=stream)
    asked = client.chat.completions.create(
        **body, extra_body={**_exact(output), "include_reasoning": True}
    )
    message = _assemble(asked)[0] if stream else _message(asked.choices[0])
    assert message["reasoning_content"] == "\nParis is in France.\n"
    assert message["content"] == "It is sunny."
    plain = client.chat.completions.create(**body, extra_body=_exact(output))
    message = _assemble(plain)[0] if stream else _message(plain.choices[0])
    assert message["content"] == output and message["reasoning_content"] is None


def test_a_conversation_with_earlier_calls_and_tool_results(client):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "18 C and sunny"},
    ]
    r = client.chat.completions.create(
        model="smollm2", messages=messages, tools=TOOLS, max_tokens=4, temperature=0.0
    )
    assert r.choices[0].message.role == "assistant"
    # the tools and the earlier call are in the prompt: it is longer than the bare question
    bare = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=1)
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens + 100


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"tool_choice": "sometimes"}, "tool_choice", "unknown"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", ""),
        ({"tools": [{"type": "function", "function": {}}]}, "tools", "name"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "response_format",
        ),
    ],
)
def test_bad_tool_fields_are_400(client, extra, param, says):
    body = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, **body)
    assert exc.value.body["param"] == param and says in exc.value.body["message"]
