"""Tool-call parsers: find the tool calls in the text a model writes, one module per format.

:func:`get_tool_parser` gives a parser by name (``hermes``, ``llama3_json``);
:func:`tool_parser_for_model` picks the one a model family writes
(``--tool-call-parser auto``).
"""

from __future__ import annotations

from backplane.api.tool_parsers.base import (
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    ToolParserDelta,
)
from backplane.api.tool_parsers.hermes import HermesToolParser
from backplane.api.tool_parsers.llama3_json import Llama3JsonToolParser
from backplane.core.errors import ConfigError

__all__ = [
    "TOOL_PARSERS",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "ToolParserDelta",
    "get_tool_parser",
    "tool_parser_for_model",
]

#: Parser name -> class.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """A tool-call parser by name.

    :param name: a key of :data:`TOOL_PARSERS`.
    :return: the parser.
    :raises ConfigError: an unknown name, listing the known ones.
    """
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ConfigError(
            f"unknown tool-call parser {name!r}; choose one of "
            f"{', '.join(['auto', *sorted(TOOL_PARSERS)])}"
        ) from None


def tool_parser_for_model(model_type: str | None, chat_template: str | None) -> ToolParser:
    """The parser of the format a model writes its calls in.

    Llama 3 templates (they name ``<|python_tag|>`` or ``<|eot_id|>``) write Llama 3
    JSON; every other family we load (Qwen, SmolLM2, and templates that know no
    tools, which are shown the Hermes format) writes Hermes blocks.

    :param model_type: the checkpoint's ``model_type`` (``"llama"``, ``"qwen3"``...).
    :param chat_template: the chat template's source, if any.
    :return: the parser.
    """
    source = chat_template or ""
    if "<tool_call>" in source:
        return HermesToolParser()
    if model_type == "llama" and ("<|python_tag|>" in source or "<|eot_id|>" in source):
        return Llama3JsonToolParser()
    return HermesToolParser()
