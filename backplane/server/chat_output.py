"""The assistant message of a chat choice: content, reasoning and tool calls.

A choice's text goes through two optional readers: the reasoning parser
(``<think>`` text to ``reasoning_content``) and then the tool-call parser (calls
to ``tool_calls``, finish reason ``"tool_calls"``). :class:`ChatOutput` builds
the whole message of a finished choice; :class:`ChatDeltas` the deltas of a
streamed one, which put together are that same message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from backplane.api.async_llm import AsyncLLM
from backplane.api.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
)
from backplane.api.tool_parsers import (
    ToolCallStream,
    ToolParser,
    get_tool_parser,
    tool_parser_for_model,
)
from backplane.api.tools import ToolChoice, messages_for_template
from backplane.engine.sampling import SamplingParams, StructuredOutputsParams
from backplane.server.protocol import BadRequest, ChatCompletionRequest

__all__ = ["ChatDeltas", "ChatFormats", "ChatOutput"]

#: The reasoning parser of a request that sets ``include_reasoning`` on a server
#: started without one: it only reads a ``<think>`` block the output opens itself.
DEFAULT_REASONING_PARSER = "qwen3"


@dataclass(frozen=True)
class ChatOutput:
    """How a request's choices are read.

    :param tool_parser: finds tool calls (``None``: the text is all content).
    :param reasoning: splits off the reasoning (``None``: reasoning stays in the content).
    """

    tool_parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a finished choice.

        :param text: the choice's text.
        :param finish_reason: the engine's finish reason.
        :return: the message (``role``, ``content``, and ``reasoning_content`` /
            ``tool_calls`` when there are some) and the finish reason, ``"tool_calls"``
            when the model called tools and was not cut short.
        """
        message: dict[str, Any] = {"role": "assistant"}
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text)
            message["reasoning_content"] = reasoning or None
        if self.tool_parser is None:
            message["content"] = content
            return message, finish_reason
        content, calls = self.tool_parser.extract(content or "")
        message["content"] = content
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return message, finish_reason


class ChatDeltas:
    """The deltas of one streamed choice.

    :param output: how the request's choices are read.
    """

    def __init__(self, output: ChatOutput) -> None:
        self._reasoning = None if output.reasoning is None else ReasoningStream(output.reasoning)
        self._tools = None if output.tool_parser is None else ToolCallStream(output.tool_parser)
        self._content_sent = 0

    def update(self, text: str, *, final: bool) -> dict[str, Any]:
        """What the choice's text so far adds to the message.

        :param text: the choice's whole text so far.
        :param final: the choice is finished.
        :return: the delta's fields (``content``, ``reasoning_content``, ``tool_calls``),
            only those that have something new.
        """
        delta: dict[str, Any] = {}
        content = text
        if self._reasoning is not None:
            reasoning = self._reasoning.update(text, final=final)
            if reasoning:
                delta["reasoning_content"] = reasoning
            content = self._reasoning.content
        if self._tools is None:
            new = content[self._content_sent :]
            self._content_sent = max(self._content_sent, len(content))
            if new:
                delta["content"] = new
            return delta
        step = self._tools.update(content, final=final)
        if step.content:
            delta["content"] = step.content
        if step.tool_calls:
            delta["tool_calls"] = [c.to_openai() for c in step.tool_calls]
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        """The finish reason of the choice's last chunk.

        :param reason: the engine's.
        :return: ``"tool_calls"`` when the stream sent calls and the model was not cut short.
        """
        called = self._tools is not None and self._tools.called
        return "tool_calls" if called and reason == "stop" else reason


class ChatFormats:
    """The server's tool-call and reasoning formats, and what they do to a chat request.

    :param tool_parser: the model's tool-call format.
    :param reasoning: the ``--reasoning-parser``, or ``None``.
    :param template_source: the chat template's source (``None``: no template).
    """

    def __init__(
        self,
        tool_parser: ToolParser,
        reasoning: ReasoningParser | None,
        template_source: str | None,
    ) -> None:
        self.tool_parser = tool_parser
        self.reasoning = reasoning
        self.template_source = template_source

    @classmethod
    def for_engine(
        cls, engine: AsyncLLM, tool_call_parser: str = "auto", reasoning_parser: str | None = None
    ) -> ChatFormats:
        """The formats of the engine's model.

        :param engine: the engine.
        :param tool_call_parser: a parser name, or ``"auto"`` (by the model family).
        :param reasoning_parser: a reasoning parser name, or ``None``.
        :return: the formats.
        :raises ConfigError: an unknown parser name, listing the known ones.
        """
        tokenizer = engine.llm.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        source = None if template is None else template.source
        if tool_call_parser == "auto":
            model_type = engine.llm.engine.model_config.get("model_type")
            parser = tool_parser_for_model(model_type, source)
        else:
            parser = get_tool_parser(tool_call_parser)
        reasoning = None if reasoning_parser is None else get_reasoning_parser(reasoning_parser)
        return cls(parser, reasoning, source)

    def prepare(
        self, body: ChatCompletionRequest, messages: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None, ChatOutput]:
        """What a request renders and how its choices are read.

        :param body: the request.
        :param messages: its messages (:func:`~backplane.server.protocol.chat_messages`).
        :return: the messages for the template, the template variables (the
            request's, with ``tools``), and how to read the choices.
        """
        tools = body.tools
        choice: ToolChoice = body.tool_choice
        template_kwargs = body.chat_template_kwargs
        if tools or any(m.get("tool_calls") for m in messages):
            messages = messages_for_template(
                messages, tools, self.template_source, self.tool_parser
            )
        if tools:
            template_kwargs = {**(template_kwargs or {}), "tools": tools}
        reasoning = self.reasoning
        if body.include_reasoning is False:
            reasoning = None
        elif body.include_reasoning and reasoning is None:
            reasoning = REASONING_PARSERS[DEFAULT_REASONING_PARSER]
        parser = choice.parser(self.tool_parser) if tools else None
        return messages, template_kwargs, ChatOutput(parser, reasoning)

    @staticmethod
    def constrain(body: ChatCompletionRequest, params: SamplingParams) -> SamplingParams:
        """The request's parameters, with the call(s) forced when ``tool_choice`` says so.

        :param body: the request.
        :param params: its sampling parameters.
        :return: the parameters, with a JSON-schema constraint for ``"required"`` or a
            named function.
        :raises BadRequest: the request also asks for another output constraint.
        """
        choice: ToolChoice = body.tool_choice
        if not choice.forced:
            return params
        if params.structured_outputs is not None:
            raise BadRequest(
                f"tool_choice {choice.mode!r} forces the output to be tool calls, so it cannot "
                "be combined with response_format or structured_outputs; drop one of them",
                "tool_choice",
            )
        schema = choice.schema(body.tools or [])
        if choice.mode == "required" and not body.parallel_tool_calls:
            schema = {**schema, "maxItems": 1}
        constraint = StructuredOutputsParams(json=schema)
        return dataclasses.replace(params, structured_outputs=constraint)
