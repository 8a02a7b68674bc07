"""Hermes-style tool calls, as Qwen and SmolLM2 write them.

Each call is a JSON object in its own block::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the blocks is the message's content. A block whose JSON is not a
call (malformed, no string ``name``) is left in the content as it was written.
"""

from __future__ import annotations

import json
from typing import Any

from backplane.api.tool_parsers.base import ParsedText, ToolParser, held_back, scan_call_object

__all__ = ["HermesToolParser"]

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

    name = "hermes"

    def parse(self, text: str, *, final: bool) -> ParsedText:
        """See :meth:`ToolParser.parse`."""
        out = ParsedText()
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                rest = text[pos:]
                keep = 0 if final else held_back(rest, START)
                out.content += rest[: len(rest) - keep]
                return out
            out.content += text[pos:start]
            body_start = start + len(START)
            end = text.find(END, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            try:
                call, _ = scan_call_object(body)
            except ValueError:
                call = None
            if end < 0:
                if final:
                    out.content += text[start:]
                elif call is not None:
                    out.calls.append(call)
                return out
            block_end = end + len(END)
            if call is not None and call.complete and not body[_object_end(body) :].strip():
                out.calls.append(call)
            elif not final and call is not None and call.name is not None:
                # its name may have been streamed already: it stays a (broken) call
                out.calls.append(call)
            else:
                out.content += text[start:block_end]
            pos = block_end

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        """See :meth:`ToolParser.tools_prompt` (the words of Qwen2.5's template)."""
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def call_text(self, name: str, arguments: dict[str, Any]) -> str:
        """See :meth:`ToolParser.call_text`."""
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{START}\n{call}\n{END}"


def _object_end(body: str) -> int:
    """Where the call object of a closed block ends (the block's length if it does not)."""
    try:
        _, end = scan_call_object(body)
    except ValueError:
        return len(body)
    return len(body) if end is None else end
