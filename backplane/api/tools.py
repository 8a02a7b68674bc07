"""Tools of a chat request: checked, shown to the chat template, and forced when asked.

``tools`` are OpenAI's function tools, ``tool_choice`` says what the model may do
with them:

- ``"auto"`` (the default with tools): the model writes text, calls, or both;
  the tool-call parser finds the calls;
- ``"none"``: the tools are still shown to the template (the model sees the
  same prompt) but nothing is parsed: the output is content;
- ``"required"`` or ``{"type": "function", "function": {"name": ...}}``: structured
  output forces the call(s) (:mod:`backplane.api.tool_parsers.forced`).

Templates that render ``tools`` get them as the ``tools`` variable; a template
that does not (SmolLM2-135M's) gets them described in the system message in
the parser's format, and earlier calls of the conversation written into the
assistant's content the same way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from backplane.api.tool_parsers import ToolParser
from backplane.api.tool_parsers.forced import (
    NamedCallParser,
    RequiredCallsParser,
    forced_calls_schema,
)
from backplane.core.errors import InvalidFieldError

__all__ = ["ToolChoice", "check_tool_choice", "check_tools", "messages_for_template"]


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """Check a request's ``tools``.

    :param tools: a list of ``{"type": "function", "function": {"name", "description"?,
        "parameters"?}}``.
    :return: the tools as plain dicts.
    :raises InvalidFieldError: (field ``tools``) naming the first tool that is not of that form.
    """
    if not isinstance(tools, list) or not tools:
        raise InvalidFieldError(
            'tools must be a non-empty list of {"type": "function", "function": {"name": ...}}',
            field="tools",
        )
    names: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise InvalidFieldError(
                f'tools[{i}] must be {{"type": "function", "function": {{...}}}}; only '
                "function tools are supported",
                field="tools",
            )
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidFieldError(
                f'tools[{i}].function must be an object with a string "name"', field="tools"
            )
        name = function["name"]
        if not name or name in names:
            raise InvalidFieldError(
                f"tools[{i}].function.name {name!r} is empty or repeated; give each tool "
                "its own name",
                field="tools",
            )
        params = function.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise InvalidFieldError(
                f"tools[{i}].function.parameters must be a JSON schema object", field="tools"
            )
        names.add(name)
        out.append({"type": "function", "function": json.loads(json.dumps(function))})
    return out


@dataclass(frozen=True)
class ToolChoice:
    """What a request lets the model do with its tools.

    :param mode: ``"none"``, ``"auto"``, ``"required"`` or ``"named"``.
    :param function: the named function (``mode == "named"``).
    """

    mode: str
    function: str | None = None

    @property
    def forced(self) -> bool:
        """Whether structured output forces the call(s)."""
        return self.mode in ("required", "named")

    def schema(self, tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The JSON schema of a forced output.

        :param tools: the checked tools.
        :return: the schema (see :func:`~backplane.api.tool_parsers.forced.forced_calls_schema`).
        """
        return forced_calls_schema(tools, self.function)

    def parser(self, auto: ToolParser) -> ToolParser | None:
        """The parser that reads the output.

        :param auto: the model's format, for ``"auto"``.
        :return: the parser, or ``None`` (``"none"``: nothing is parsed).
        """
        if self.mode == "named":
            return NamedCallParser(self.function or "")
        if self.mode == "required":
            return RequiredCallsParser()
        return auto if self.mode == "auto" else None


def check_tool_choice(choice: Any, tools: Sequence[dict[str, Any]] | None) -> ToolChoice:
    """Check a request's ``tool_choice`` against its tools.

    :param choice: ``None`` (``"auto"`` with tools, ``"none"`` without), ``"none"``,
        ``"auto"``, ``"required"`` or ``{"type": "function", "function": {"name": ...}}``.
    :param tools: the checked tools, or ``None``.
    :return: the choice.
    :raises InvalidFieldError: (field ``tool_choice``) an unknown value, or a choice
        that needs tools when there are none, or names a function that is not one of them.
    """
    field = "tool_choice"
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidFieldError(
                f'tool_choice {choice!r} is unknown; give "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}',
                field=field,
            )
        if choice != "none" and not tools:
            raise InvalidFieldError(
                f'tool_choice "{choice}" needs tools; pass the functions in "tools"', field=field
            )
        return ToolChoice(choice)
    function = choice.get("function") if isinstance(choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise InvalidFieldError(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}', field=field
        )
    known = [t["function"]["name"] for t in tools or ()]
    if name not in known:
        raise InvalidFieldError(
            f"tool_choice names the function {name!r}, which is not in tools "
            f"({', '.join(known) or 'none given'})",
            field=field,
        )
    return ToolChoice("named", name)


def messages_for_template(
    messages: Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_source: str | None,
    parser: ToolParser,
) -> list[dict[str, Any]]:
    """The conversation as the chat template should see it.

    The arguments of earlier calls become objects (templates write them with
    ``tojson``). For a template that renders neither ``tools`` nor ``tool_calls``,
    the tools are described in the system message and earlier calls written
    into the assistant's content, both in ``parser``'s format.

    :param messages: the checked messages.
    :param tools: the checked tools, or ``None``.
    :param template_source: the chat template's source (``None``: unknown, rendered as it is).
    :param parser: the model's tool-call format.
    :return: new message dicts.
    :raises InvalidFieldError: (field ``messages``) a ``tool_calls`` entry that is not a
        function call with JSON arguments.
    """
    source = template_source or ""
    out = []
    for i, m in enumerate(messages):
        msg = dict(m)
        if msg.get("tool_calls"):
            msg["tool_calls"] = [_call_for_template(i, c) for c in msg["tool_calls"]]
            if template_source is not None and "tool_calls" not in source:
                written = [
                    parser.call_text(c["function"]["name"], c["function"]["arguments"])
                    for c in msg.pop("tool_calls")
                ]
                msg["content"] = "\n".join(filter(None, [msg.get("content") or "", *written]))
        out.append(msg)
    if tools and template_source is not None and "tools" not in source:
        prompt = parser.tools_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_for_template(i: int, call: Any) -> dict[str, Any]:
    """One ``tool_calls`` item of message ``i`` with its arguments as an object."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidFieldError(
            f'messages[{i}].tool_calls items are {{"id", "type": "function", "function": '
            '{"name", "arguments"}}',
            field="messages",
        )
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise InvalidFieldError(
                f"messages[{i}].tool_calls: the arguments of {function['name']!r} are not "
                "JSON; send them as OpenAI returned them (a JSON object as a string)",
                field="messages",
            ) from None
    return {**dict(call), "function": {**dict(function), "arguments": arguments}}


def with_tools(
    conversation: Sequence[Mapping[str, Any]],
    tools: Any,
    template_source: str | None,
    parser: ToolParser,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """A conversation and template variables ready to render with ``tools``.

    :param conversation: the messages.
    :param tools: the caller's tools (checked here), or ``None``.
    :param template_source: the chat template's source (``None``: unknown).
    :param parser: the model's tool-call format (for templates that render no tools).
    :param chat_template_kwargs: the caller's further template variables.
    :return: the messages for the template and the template variables (with ``tools``).
    :raises InvalidFieldError: malformed tools or tool calls.
    """
    checked = check_tools(tools) if tools is not None else None
    messages = [dict(m) for m in conversation]
    if checked or any(m.get("tool_calls") for m in messages):
        messages = messages_for_template(messages, checked, template_source, parser)
    kwargs = dict(chat_template_kwargs) if chat_template_kwargs is not None else None
    if checked:
        kwargs = {**(kwargs or {}), "tools": checked}
    return messages, kwargs
