"""What every tool-call parser shares: the call types, a JSON object scanner, streaming deltas.

A parser reads the text a model wrote and finds the tool calls in it. Each
format (:mod:`.hermes`, :mod:`.llama3_json`) only says where calls are and
which keys they use; turning a growing text into OpenAI's streamed deltas is
done here, once, by re-reading the whole text at each step and sending what
was not sent yet. So the deltas of a stream, put together, are exactly what
the parser finds in the finished text, with one exception: a call whose name
was sent before its JSON turned out malformed cannot be taken back, so the
stream ends it as sent, where the finished text keeps the block as content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ParsedText",
    "PartialCall",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "ToolParserDelta",
    "held_back",
    "new_call_id",
    "next_call",
    "scan_call_object",
]


def new_call_id() -> str:
    """A new tool-call id in OpenAI's form (``call_`` and 24 hex digits).

    :return: the id.
    """
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One finished tool call.

    :param name: the function's name.
    :param arguments: the arguments as a JSON text (an object), as OpenAI sends them.
    :param id: the call's id.
    """

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        """The call as an item of an OpenAI message's ``tool_calls``.

        :return: ``{"id", "type": "function", "function": {"name", "arguments"}}``.
        """
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class PartialCall:
    """A tool call as far as the text written so far shows it.

    :param name: the function's name, once its string is complete.
    :param arguments: the arguments' JSON text written so far (all of it once ``complete``).
    :param complete: the call's markup is closed and it is a valid call.
    :param streamable: the arguments may be sent as they grow (an object written in
        place); otherwise they are sent whole when the call is complete.
    """

    name: str | None = None
    arguments: str = ""
    complete: bool = False
    streamable: bool = True


@dataclass
class ParsedText:
    """What a parser finds in a text.

    :param content: the text that is not tool-call markup; while the text is still
        growing, the part that is sure not to become markup.
    :param calls: the calls, in order (while growing, the last one may be partial).
    """

    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _scan_value(text: str, i: int) -> int | None:
    """The end of the JSON value starting at ``text[i]``; ``None`` if the text ends first.

    :raises ValueError: the text cannot be JSON there.
    """
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if c in "{[":
        depth, j, in_string = 0, i, False
        while j < len(text):
            ch = text[j]
            if in_string:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    if j == i:
        raise ValueError(f"no JSON value at {i}")
    return j if j < len(text) else None


def scan_call_object(
    text: str, *, arguments_keys: tuple[str, ...] = ("arguments", "parameters")
) -> tuple[PartialCall, int | None]:
    """Read a call object ``{"name": ..., "arguments": {...}}`` that may be cut short.

    :param text: the text, starting at the object's ``{`` (leading blanks allowed).
    :param arguments_keys: the keys that hold the arguments.
    :return: the call as far as it goes, and the end of the object in ``text``
        (``None`` while it is not closed). A closed object is ``complete`` only if it
        is valid JSON with a string ``name``.
    :raises ValueError: the text is not the start of a JSON object.
    """
    start = _skip_space(text, 0)
    if start >= len(text):
        return PartialCall(), None
    if text[start] != "{":
        raise ValueError("a tool call is a JSON object")
    call = PartialCall()
    i = start + 1
    while True:
        i = _skip_space(text, i)
        if i >= len(text):
            return call, None
        if text[i] == "}":
            end = i + 1
            break
        if text[i] == ",":
            i += 1
            continue
        key_end = _scan_value(text, i)
        if key_end is None:
            return call, None
        try:
            key = json.loads(text[i:key_end])
        except ValueError as exc:
            raise ValueError(f"bad key: {exc}") from None
        i = _skip_space(text, key_end)
        if i >= len(text):
            return call, None
        if text[i] != ":":
            raise ValueError("expected ':' after a key")
        i = _skip_space(text, i + 1)
        value_end = _scan_value(text, i)
        if key in arguments_keys and i < len(text):
            call.streamable = text[i] == "{"
            call.arguments = text[i : value_end if value_end is not None else len(text)]
        if value_end is None:
            return call, None
        if key == "name":
            name = json.loads(text[i:value_end])
            call.name = name if isinstance(name, str) else None
        i = value_end
    try:
        obj = json.loads(text[start:end])
    except ValueError:
        return call, end
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return call, end
    args: Any = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(args, str):
        # a model that writes the arguments as a JSON string of an object
        try:
            args = json.loads(args)
        except ValueError:
            return call, end
        call.streamable = False
    if not isinstance(args, dict):
        return call, end
    if not call.streamable or not call.arguments:
        call.arguments = json.dumps(args, ensure_ascii=False)
        call.streamable = False
    call.name = obj["name"]
    call.complete = True
    return call, end


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``.

    :param text: the text written so far.
    :param marker: markup that may follow.
    :return: the length of the longest end of ``text`` that is a prefix of ``marker``.
    """
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """A tool-call format: finds the calls in the text a model writes.

    Subclasses set :attr:`name` and implement :meth:`parse`.
    """

    #: the name the registry and ``--tool-call-parser`` use.
    name: str = ""

    def parse(self, text: str, *, final: bool) -> ParsedText:
        """Find the content and the calls in ``text``.

        :param text: the text the model has written so far.
        :param final: the text is finished: nothing is held back, and markup that
            did not make a valid call is content.
        :return: the content and the calls.
        """
        raise NotImplementedError

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        """A system-prompt text that shows the model the tools and this format.

        Used for chat templates that do not render ``tools`` themselves.

        :param tools: OpenAI's tool objects.
        :return: the text.
        """
        raise NotImplementedError

    def call_text(self, name: str, arguments: dict[str, Any]) -> str:
        """A call written in this format (for earlier calls of a conversation whose
        chat template does not render ``tool_calls``).

        :param name: the function's name.
        :param arguments: its arguments.
        :return: the text the model would have written.
        """
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content and the tool calls of a finished text.

        :param text: the model's whole output.
        :return: the content (``None`` when there is none besides the calls) and the calls.
        """
        parsed = self.parse(text, final=True)
        calls = [ToolCall(c.name or "", c.arguments) for c in parsed.calls if c.complete]
        if not calls:
            return parsed.content, calls
        # the blank lines around the call blocks are no content
        return parsed.content.rstrip() or None, calls


@dataclass
class ToolCallDelta:
    """One streamed piece of a tool call, as OpenAI's ``delta.tool_calls`` items.

    :param index: which call of the message.
    :param id: the call's id (first piece only).
    :param name: the function's name (first piece only).
    :param arguments: the next characters of the arguments' JSON text.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """The piece as an item of ``delta.tool_calls``.

        :return: ``{"index", "id"?, "type"?, "function": {"name"?, "arguments"}}``.
        """
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass
class ToolParserDelta:
    """What one step of a stream adds.

    :param content: new content text.
    :param tool_calls: new pieces of tool calls.
    """

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallStream:
    """One streamed message: turns its growing text into content and tool-call deltas.

    :param parser: the format.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._content_sent = 0
        self._ids: list[str] = []
        self._args_sent: list[int] = []
        self.called = False

    def update(self, text: str, *, final: bool = False) -> ToolParserDelta:
        """Read the text so far and return what was not sent yet.

        :param text: the whole text written so far (each call passes a longer one).
        :param final: the text is finished.
        :return: the new content and tool-call pieces.
        """
        parsed = self.parser.parse(text, final=final)
        if final and sum(c.complete for c in parsed.calls) < len(self._ids):
            # a call already sent is no call in the finished text: end the stream as sent
            parsed = self.parser.parse(text, final=False)
        complete = [c for c in parsed.calls if c.complete]
        # blanks at the end wait for more text: after the last call they are dropped
        content = parsed.content
        if not final or complete or self._ids:
            content = content.rstrip()
        delta = ToolParserDelta(content=content[self._content_sent :])
        self._content_sent = max(self._content_sent, len(content))
        for index, call in enumerate(parsed.calls):
            if call.name is None or (final and not call.complete and index >= len(self._ids)):
                break
            if index == len(self._ids):
                self._ids.append(new_call_id())
                self._args_sent.append(0)
                piece = ToolCallDelta(index, id=self._ids[index], name=call.name)
            elif index < len(self._ids):
                piece = ToolCallDelta(index)
            else:
                piece = ToolCallDelta(index)
            if call.streamable or call.complete:
                piece.arguments = call.arguments[self._args_sent[index] :]
                self._args_sent[index] = len(call.arguments)
            if piece.id is not None or piece.arguments:
                delta.tool_calls.append(piece)
        self.called = self.called or bool(self._ids)
        return delta


def next_call(rest: str, calls: list[PartialCall], text: str, *, final: bool) -> int | ParsedText:
    """Read one call object at the start of ``rest`` into ``calls``.

    :param rest: the text from the call object's ``{`` on.
    :param calls: the calls read so far; a complete call (or, mid-stream, a cut one) is added.
    :param text: the whole output, returned as content when it turns out not to be calls.
    :param final: the output is complete (a cut or malformed call is then content).
    :return: where the call ends in ``rest`` (read on from there), or the parse's result when
        the text ends or breaks here.
    """
    try:
        call, end = scan_call_object(rest)
    except ValueError:
        return ParsedText(content=text) if final else ParsedText(calls=calls)
    if end is None:
        if final:
            return ParsedText(content=text)
        calls.append(call)
        return ParsedText(calls=calls)
    if not call.complete:
        return ParsedText(content=text) if final else ParsedText(calls=calls)
    calls.append(call)
    return end
