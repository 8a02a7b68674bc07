"""Llama 3 JSON tool calls: the message is the call(s), as JSON objects.

Llama 3.1 / 3.2 write a call as the whole message, possibly after the
``<|python_tag|>`` token, with the arguments under ``parameters``::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

Several calls are separated by ``;``. A message that does not start with
``{`` (after blanks and the tag), or whose JSON is not calls, is content.
"""

from __future__ import annotations

import json
from typing import Any

from backplane.api.tool_parsers.base import (
    ParsedText,
    PartialCall,
    ToolParser,
    held_back,
    next_call,
)

__all__ = ["Llama3JsonToolParser"]

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """``{"name": ..., "parameters": {...}}`` (``; {...}`` for more), optionally after
    ``<|python_tag|>``."""

    name = "llama3_json"

    def parse(self, text: str, *, final: bool) -> ParsedText:
        """See :meth:`ToolParser.parse`."""
        head = text.lstrip()
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG) :].lstrip()
        elif not final and head and held_back(head, PYTHON_TAG) == len(head):
            return ParsedText()  # the tag may be on its way
        if not head:
            return ParsedText(content=text if final else "")
        if not head.startswith("{"):
            return ParsedText(content=text)
        calls: list[PartialCall] = []
        pos = 0
        while True:
            step = next_call(head[pos:], calls, text, final=final)
            if isinstance(step, ParsedText):
                return step
            pos += step
            rest = head[pos:].lstrip()
            if not rest:
                return ParsedText(calls=calls)
            if not rest.startswith(";"):
                return ParsedText(content=text) if final else ParsedText(calls=calls)
            pos = len(head) - len(rest) + 1
            if not head[pos:].strip():
                # a separator with nothing after it yet (or ever)
                return ParsedText(calls=calls)

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        """See :meth:`ToolParser.tools_prompt` (the words of Llama 3.1's template)."""
        listed = "\n\n".join(json.dumps(t, ensure_ascii=False, indent=4) for t in tools)
        return (
            "Given the following functions, please respond with a JSON for a function call "
            "with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables.\n\n" + listed
        )

    def call_text(self, name: str, arguments: dict[str, Any]) -> str:
        """See :meth:`ToolParser.call_text`."""
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
