"""Tool calls and reasoning: the parsers on fixed strings, streamed deltas against the
finished text, tools and tool_choice checks, and the conversation the template sees."""

from __future__ import annotations

import json
import random

import pytest

from backplane.api.reasoning import REASONING_PARSERS, ReasoningStream, get_reasoning_parser
from backplane.api.tool_parsers import ToolCallStream, get_tool_parser, tool_parser_for_model
from backplane.api.tool_parsers.forced import (
    NamedCallParser,
    RequiredCallsParser,
    forced_calls_schema,
)
from backplane.api.tools import check_tool_choice, check_tools, messages_for_template
from backplane.core.errors import ConfigError, InvalidFieldError

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"zone": "Europe/Paris", "note": 'a "quoted" } brace, and ünïcode'}


def _hermes(name: str, args: object, key: str = "arguments") -> str:
    return f"<tool_call>\n{json.dumps({'name': name, key: args})}\n</tool_call>"


# (parser, text, expected content, expected [(name, arguments object)])
CASES = [
    ("hermes", "Just text, no calls.", "Just text, no calls.", []),
    ("hermes", _hermes("get_weather", WEATHER), None, [("get_weather", WEATHER)]),
    (
        "hermes",
        "Let me check.\n" + _hermes("get_weather", WEATHER) + "\n" + _hermes("get_time", TIME),
        "Let me check.",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    # arguments written as a JSON string of an object
    (
        "hermes",
        _hermes("get_weather", json.dumps(WEATHER)),
        None,
        [("get_weather", WEATHER)],
    ),
    # malformed JSON and a block without a name stay content, as written
    (
        "hermes",
        'Before <tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call> after',
        'Before <tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call> after',
        [],
    ),
    (
        "hermes",
        '<tool_call>{"arguments": {}}</tool_call>' + _hermes("get_time", TIME),
        '<tool_call>{"arguments": {}}</tool_call>',
        [("get_time", TIME)],
    ),
    # an unclosed block at the end (cut by max_tokens) is content
    (
        "hermes",
        'Hi <tool_call>{"name": "get_weather", "argum',
        'Hi <tool_call>{"name": "get_weather", "argum',
        [],
    ),
    ("hermes", "a < b and <tool_ is not a tag", "a < b and <tool_ is not a tag", []),
    (
        "llama3_json",
        json.dumps({"name": "get_weather", "parameters": WEATHER}),
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",
        "<|python_tag|>"
        + json.dumps({"name": "get_weather", "parameters": WEATHER})
        + "; "
        + json.dumps({"name": "get_time", "arguments": TIME}),
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"ci',
        '{"name": "get_weather", "parameters": {"ci',
        [],
    ),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    (
        "llama3_json",
        json.dumps({"name": "f", "parameters": {}}) + " trailing words",
        json.dumps({"name": "f", "parameters": {}}) + " trailing words",
        [],
    ),
]


#: What a stream sent character by character for the texts whose calls broke after their name.
SENT_BEFORE_BROKEN = {
    CASES[4][1]: ("Before  after", [("get_weather", '{"city": }')]),
    CASES[6][1]: ("Hi", [("get_weather", "")]),
    CASES[11][1]: ("", [("get_weather", '{"ci')]),
    CASES[13][1]: ("", [("f", "{}")]),
}


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_parser_finds_content_and_calls(name, text, content, calls):
    found_content, found = get_tool_parser(name).extract(text)
    assert found_content == content
    assert _calls(found) == calls
    for c in found:
        assert c.id.startswith("call_") and len(c.id) > 10
        assert c.to_openai()["type"] == "function"
        assert isinstance(c.to_openai()["function"]["arguments"], str)
    assert len({c.id for c in found}) == len(found)


def _stream(parser, text: str, cuts: list[int]):
    """Feed ``text`` cut at ``cuts``; put the deltas together as a client does."""
    stream = ToolCallStream(parser)
    content, calls = "", {}
    pieces = [*(stream.update(text[:c]) for c in cuts), stream.update(text, final=True)]
    for d in pieces:
        content += d.content
        for tc in d.tool_calls:
            piece = tc.to_openai()
            if tc.index not in calls:
                # the first piece of a call carries its id, type and name
                assert piece["id"].startswith("call_") and piece["type"] == "function"
                assert tc.index == len(calls)
                calls[tc.index] = [piece["function"]["name"], ""]
            else:
                assert "id" not in piece and "name" not in piece["function"]
            calls[tc.index][1] += piece["function"]["arguments"]
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_streamed_deltas_put_together_equal_the_finished_message(name, text, content, calls):
    parser = get_tool_parser(name)
    want_content, want_calls = parser.extract(text)
    want = (want_content or "", [(c.name, c.arguments) for c in want_calls])
    rng = random.Random(len(text))
    for cuts in (list(range(1, len(text))), sorted(rng.sample(range(1, len(text)), 5))):
        got = _stream(parser, text, cuts)
        if text in SENT_BEFORE_BROKEN and got[1]:
            # a call whose name was streamed before its JSON went wrong cannot be taken
            # back (as in vLLM): the stream ends it as it was sent, its markup no content
            sent = SENT_BEFORE_BROKEN[text]
            assert got[0] == sent[0] and [n for n, _ in got[1]] == [n for n, _ in sent[1]]
            if cuts[0] == 1:
                assert got == sent
        else:
            assert got == want, cuts


def test_streamed_content_never_shows_call_markup():
    text = "Checking.\n" + _hermes("get_weather", WEATHER) + "\nDone."
    stream = ToolCallStream(get_tool_parser("hermes"))
    sent = ""
    for i in range(1, len(text) + 1):
        sent += stream.update(text[:i]).content
        assert "<" not in sent and "{" not in sent
    sent += stream.update(text, final=True).content
    assert sent == "Checking.\n\nDone." == get_tool_parser("hermes").extract(text)[0]


def test_forced_parsers_read_structured_output():
    args = json.dumps(WEATHER, indent=2)
    content, calls = NamedCallParser("get_weather").extract(f" {args} ")
    assert content is None and _calls(calls) == [("get_weather", WEATHER)]
    text = json.dumps(
        [{"name": "get_weather", "parameters": WEATHER}, {"name": "get_time", "parameters": TIME}]
    )
    content, calls = RequiredCallsParser().extract(text)
    assert content is None and _calls(calls) == [("get_weather", WEATHER), ("get_time", TIME)]
    assert RequiredCallsParser().extract("[]") == ("[]", [])
    assert NamedCallParser("f").extract('{"a": ') == ('{"a": ', [])
    for parser, out in ((NamedCallParser("get_weather"), f"{args}"), (RequiredCallsParser(), text)):
        got = _stream(parser, out, list(range(1, len(out))))
        want = parser.extract(out)[1]
        assert got == ("", [(c.name, c.arguments) for c in want])


def test_forced_schema_accepts_the_calls_and_refuses_others():
    jsonschema = pytest.importorskip("jsonschema")
    tools = check_tools(TOOLS)
    required = forced_calls_schema(tools, None)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], required)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    named = forced_calls_schema(tools, "get_weather")
    jsonschema.validate({"city": "Oslo"}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"unit": "kelvin"}, named)


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        ("deepseek_r1", "<think>\nsum it\n</think>\n\n42", "\nsum it\n", "42"),
        ("deepseek_r1", "sum it</think>42", "sum it", "42"),
        ("deepseek_r1", "still thinking", "still thinking", ""),
        ("qwen3", "<think>sum it</think>\n42", "sum it", "42"),
        ("qwen3", "42, no thinking", "", "42, no thinking"),
        ("qwen3", "x</think>y", "", "x</think>y"),
        ("qwen3", "<think>cut sho", "cut sho", ""),
    ],
)
def test_reasoning_split_and_stream(parser, text, reasoning, content):
    p = get_reasoning_parser(parser)
    assert p.split(text) == (reasoning, content)
    stream, streamed = ReasoningStream(p), ""
    for i in range(1, len(text) + 1):
        streamed += stream.update(text[:i])
        assert "<" not in streamed
    streamed += stream.update(text, final=True)
    assert (streamed, stream.content) == (reasoning, content)


def test_unknown_parser_names_list_the_known_ones():
    with pytest.raises(ConfigError, match="hermes.*llama3_json"):
        get_tool_parser("mistral")
    with pytest.raises(ConfigError, match=", ".join(REASONING_PARSERS)):
        get_reasoning_parser("r2")


def test_auto_parser_by_family():
    llama3 = "{{ '<|start_header_id|>' }}{% if tools %}{{ '<|python_tag|>' }}{% endif %}<|eot_id|>"
    assert tool_parser_for_model("llama", llama3).name == "llama3_json"
    assert tool_parser_for_model("qwen3", "<tool_call>{{ tools }}</tool_call>").name == "hermes"
    assert tool_parser_for_model("llama", "<|im_start|>{{ m }}").name == "hermes"  # SmolLM2
    assert tool_parser_for_model(None, None).name == "hermes"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


@pytest.mark.parametrize(
    ("tools", "says"),
    [
        ([], "non-empty list"),
        ([{"type": "retrieval"}], "only function tools"),
        ([{"type": "function", "function": {"description": "x"}}], 'string "name"'),
        ([TOOLS[1], TOOLS[1]], "repeated"),
        ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "JSON schema"),
    ],
)
def test_bad_tools_are_refused(tools, says):
    with pytest.raises(InvalidFieldError, match=says) as exc:
        check_tools(tools)
    assert exc.value.field == "tools"


def test_tool_choice():
    tools = check_tools(TOOLS)
    assert check_tool_choice(None, tools).mode == "auto"
    assert check_tool_choice(None, None).mode == "none"
    named = check_tool_choice({"type": "function", "function": {"name": "get_time"}}, tools)
    assert (named.mode, named.function, named.forced) == ("named", "get_time", True)
    assert check_tool_choice("required", tools).forced
    assert check_tool_choice("none", tools).parser(get_tool_parser("hermes")) is None
    for choice, tools_, says in (
        ("sometimes", tools, "unknown"),
        ("required", None, "needs tools"),
        ({"type": "function", "function": {"name": "nope"}}, tools, "not in tools"),
        ({"function": "get_time"}, tools, "named tool_choice"),
    ):
        with pytest.raises(InvalidFieldError, match=says) as exc:
            check_tool_choice(choice, tools_)
        assert exc.value.field == "tool_choice"


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(WEATHER)},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]

# the tool parts of Qwen2.5's template, shortened
TOOL_TEMPLATE = """{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>
{% endif %}
{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}
{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", \
"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{% endif %}
{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_template_that_renders_tools_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from backplane.models.chat import ChatTemplate

    tools = check_tools(TOOLS)
    messages = messages_for_template(CONVERSATION, tools, TOOL_TEMPLATE, get_tool_parser("hermes"))
    ours = ChatTemplate(TOOL_TEMPLATE).render(messages, tools=tools)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=__import__("tokenizers").Tokenizer(
            __import__("tokenizers").models.WordLevel({"a": 0}, unk_token="a")
        )
    )
    tok.chat_template = TOOL_TEMPLATE
    # transformers parses earlier calls' arguments the same way before rendering
    conv = json.loads(json.dumps(CONVERSATION))
    conv[1]["tool_calls"][0]["function"]["arguments"] = WEATHER
    theirs = tok.apply_chat_template(conv, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert json.dumps(TOOLS[0]) in ours and '"arguments": {"city": "Paris"' in ours


def test_template_without_tools_gets_them_in_the_system_message():
    from backplane.models.chat import ChatTemplate

    plain = "{% for m in messages %}<|{{ m.role }}|>{{ m['content'] }}\n{% endfor %}"
    tools = check_tools(TOOLS)
    parser = get_tool_parser("hermes")
    messages = messages_for_template(CONVERSATION, tools, plain, parser)
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    text = ChatTemplate(plain).render(messages, tools=tools)
    # the earlier call is written as the model writes calls, and reads back as that call
    assistant = text.split("<|assistant|>")[1].split("<|tool|>")[0]
    assert _calls(parser.extract(assistant)[1]) == [("get_weather", WEATHER)]
    with pytest.raises(InvalidFieldError, match="not JSON"):
        bad = json.loads(json.dumps(CONVERSATION))
        bad[1]["tool_calls"][0]["function"]["arguments"] = "{city"
        messages_for_template(bad, tools, plain, parser)


@pytest.mark.parametrize(
    ("flag", "value"), [("--tool-call-parser", "mistral"), ("--reasoning-parser", "r2")]
)
def test_serve_refuses_an_unknown_parser_before_loading(flag, value, capsys):
    pytest.importorskip("fastapi")
    from backplane.cli import main

    assert main(["serve", "tiny-llama", flag, value]) == 2
    err = capsys.readouterr().err
    assert flag in err and value in err and "choose one of" in err


def test_llm_chat_gives_the_template_its_tools_and_earlier_calls():
    from backplane import LLM, SamplingParams

    llm = LLM("smollm2", device="cpu", max_num_seqs=2)
    try:
        params = SamplingParams(max_tokens=1)
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        plain = llm.chat(ask, params, use_tqdm=False)[0].prompt
        with_tools = llm.chat(ask, params, tools=TOOLS, use_tqdm=False)[0].prompt
        assert "get_weather" not in plain
        for tool in TOOLS:
            assert tool["function"]["name"] in with_tools
            assert tool["function"].get("description", "") in with_tools
        assert with_tools.endswith(plain[plain.rindex("<|im_start|>user") :])
        # an earlier call is written in the model's own format, which reads back as that call
        later = llm.chat(CONVERSATION, params, tools=TOOLS, use_tqdm=False)[0].prompt
        parser = get_tool_parser("hermes")
        assistant = later.split("<|im_start|>assistant")[1].split("<|im_end|>")[0]
        assert _calls(parser.extract(assistant)[1]) == [("get_weather", WEATHER)]
        with pytest.raises(InvalidFieldError, match="tools"):
            llm.chat(ask, params, tools=[{"type": "retrieval"}], use_tqdm=False)
    finally:
        llm.shutdown()
