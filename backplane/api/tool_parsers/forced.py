"""Calls that structured output forces: ``tool_choice`` ``"required"`` or a named function.

With a forced choice the model writes no markup, only JSON that a schema
allows (vLLM's forms):

- a named function: the output is the call's arguments object;
- ``"required"``: the output is a non-empty array of ``{"name", "parameters"}``
  objects, one per call.

:func:`forced_calls_schema` gives the schema; the parsers here read the output
back as calls, streamed like any other format.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from backplane.api.tool_parsers.base import ParsedText, PartialCall, ToolParser, next_call

__all__ = ["NamedCallParser", "RequiredCallsParser", "forced_calls_schema"]


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def forced_calls_schema(tools: Sequence[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """The JSON schema of the output when calls are forced.

    :param tools: the request's tools (OpenAI's ``{"type": "function", "function": {...}}``).
    :param name: the named function, or ``None`` for ``"required"`` (any of the tools).
    :return: the schema.
    """
    if name is not None:
        tool = next(t for t in tools if t["function"]["name"] == name)
        return _parameters(tool)
    one = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": one}}


class NamedCallParser(ToolParser):
    """The output is the arguments of one call of a known function.

    :param function: the function's name.
    """

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, *, final: bool) -> ParsedText:
        """See :meth:`ToolParser.parse`."""
        arguments = text.strip()
        call = PartialCall(name=self.function, arguments=arguments)
        if final:
            try:
                valid = isinstance(json.loads(arguments), dict)
            except ValueError:
                valid = False
            if not valid:
                return ParsedText(content=text)
            call.complete = True
        return ParsedText(calls=[call])


class RequiredCallsParser(ToolParser):
    """The output is ``[{"name": ..., "parameters": {...}}, ...]``."""

    name = "required"

    def parse(self, text: str, *, final: bool) -> ParsedText:
        """See :meth:`ToolParser.parse`."""
        body = text.lstrip()
        calls: list[PartialCall] = []
        if not body.startswith("["):
            return ParsedText(content=text if final else "")
        pos = 1
        while True:
            rest = body[pos:].lstrip()
            pos = len(body) - len(rest)
            if rest.startswith(","):
                pos += 1
                continue
            if rest.startswith("]") or not rest:
                if final and (not rest or rest[1:].strip() or not calls):
                    return ParsedText(content=text)
                return ParsedText(calls=calls)
            step = next_call(rest, calls, text, final=final)
            if isinstance(step, ParsedText):
                return step
            pos += step
