"""Reasoning text: what a thinking model writes between ``<think>`` and ``</think>``.

With a reasoning parser the server returns that text as the message's
``reasoning_content`` and the rest as its ``content``. The parsers are named
as vLLM's ``--reasoning-parser``:

- ``deepseek_r1``: the template may open the ``<think>`` block in the prompt, so
  everything up to ``</think>`` is reasoning (all of it while no ``</think>`` came);
- ``qwen3``: reasoning only when the output opens with ``<think>``; otherwise all
  of it is content (Qwen3 with ``enable_thinking=False``).

A block still open when the output ends (cut by ``max_tokens``) is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from backplane.api.tool_parsers.base import held_back
from backplane.core.errors import ConfigError

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]

START = "<think>"
END = "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """Splits a model's output into reasoning and content.

    :param name: the parser's name.
    :param open_in_prompt: the ``<think>`` block may have been opened by the prompt,
        so text before ``</think>`` is reasoning even without ``<think>``.
    """

    name: str
    open_in_prompt: bool

    def split(self, text: str, *, final: bool = True) -> tuple[str, str]:
        """The reasoning and the content of ``text``.

        :param text: the output so far.
        :param final: the output is finished (while not, a possible start of
            ``<think>`` or ``</think>`` at the end is held back from both).
        :return: ``(reasoning, content)``; the markers belong to neither.
        """
        body = text.lstrip()
        opened = body.startswith(START)
        if opened:
            body = body[len(START) :]
        elif not final and body and held_back(body, START) == len(body):
            return "", ""
        elif not self.open_in_prompt:
            return "", text
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END) :].lstrip()
        keep = 0 if final else held_back(body, END)
        return body[: len(body) - keep], ""


#: Parser name -> parser.
REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", open_in_prompt=True),
    "qwen3": ReasoningParser("qwen3", open_in_prompt=False),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """A reasoning parser by name.

    :param name: a key of :data:`REASONING_PARSERS`.
    :return: the parser.
    :raises ConfigError: an unknown name, listing the known ones.
    """
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ConfigError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}"
        ) from None


class ReasoningStream:
    """One streamed message: the growing output split into reasoning and content deltas.

    :param parser: the parser.
    """

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._reasoning_sent = 0
        self.content = ""

    def update(self, text: str, *, final: bool = False) -> str:
        """Read the output so far; return the new reasoning text.

        :param text: the whole output so far.
        :param final: the output is finished.
        :return: reasoning not returned before; :attr:`content` holds all the content so far.
        """
        reasoning, content = self.parser.split(text, final=final)
        new = reasoning[self._reasoning_sent :]
        self._reasoning_sent = max(self._reasoning_sent, len(reasoning))
        if len(content) >= len(self.content):
            self.content = content
        return new
