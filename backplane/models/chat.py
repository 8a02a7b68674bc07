"""Chat templates: the Jinja template a checkpoint ships, rendered the way transformers does.

A chat template turns a conversation (a list of ``{"role", "content"}``
messages) into the prompt text the model was trained on. Checkpoints carry it
in their tokenizer files (``chat_template.jinja``, ``tokenizer_config.json``)
or in the GGUF metadata (``tokenizer.chat_template``). Templates are rendered
in a sandboxed Jinja environment set up like transformers' own
(``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text and takes ``indent``,
``separators`` and ``sort_keys``), so the same template gives the same text
here and in transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from backplane.core.errors import ConfigError, InvalidFieldError, RequestError
from backplane.core.text import find_invalid_text

#: A message: ``{"role": "user", "content": "..."}`` (other keys pass through to the template).
Message = Mapping[str, Any]

#: Template variables the renderer sets itself; ``chat_template_kwargs`` may not name them.
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt"})


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        # ``{% generation %}...{% endgeneration %}`` marks assistant text for training
        # masks; for inference it renders its body unchanged.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check the further template variables a caller passes (``chat_template_kwargs``).

    :param kwargs: variable name -> value, or ``None`` for none.
    :return: the variables as a new dict (empty for ``None``).
    :raises InvalidFieldError: (field ``"chat_template_kwargs"``) not a mapping of string
        names, a name the renderer sets itself (:data:`RESERVED_VARIABLES`), or a string
        that is not UTF-8 text.
    """
    field = "chat_template_kwargs"
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidFieldError(
            f"chat_template_kwargs must be a mapping of variable names to values; got "
            f"{type(kwargs).__name__}",
            field=field,
        )
    reserved = sorted(RESERVED_VARIABLES.intersection(kwargs))
    if reserved:
        raise InvalidFieldError(
            f"chat_template_kwargs names {', '.join(reserved)}, which the renderer sets "
            "itself; pass the conversation as the messages and add_generation_prompt as its "
            "own argument",
            field=field,
        )
    where = find_invalid_text(kwargs, field)
    if where is not None:
        raise InvalidFieldError(_not_text(where), field=field)
    return dict(kwargs)


def _not_text(where: str) -> str:
    return (
        f"{where} holds a string that is not UTF-8 text (a lone surrogate such as \\ud800); "
        "send valid Unicode text"
    )


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Check one conversation and return it as a list of plain dicts.

    :param messages: a list of ``{"role": str, "content": str}`` mappings.
    :return: the messages as dicts (copies: the template never sees the caller's objects).
    :raises RequestError: naming the first message that is not of that form
        (an :class:`InvalidFieldError` of field ``"messages"`` for text that is not UTF-8).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise RequestError(
            'a conversation is a non-empty list of {"role": ..., "content": ...} messages'
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise RequestError(
                f'message {i} must be a mapping with a string "role" (and "content"); got {m!r}'
            )
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(
                f'message {i}: "content" must be a string (or a list of content parts); '
                f"got {type(content).__name__}"
            )
        where = find_invalid_text(m, f"messages[{i}]")
        if where is not None:
            raise InvalidFieldError(_not_text(where), field="messages")
        out.append(dict(m))
    return out


class ChatTemplate:
    """A compiled chat template.

    :param source: the Jinja source.
    :param origin: where it came from (a file, a GGUF key), for error messages.
    :raises ConfigError: when the template does not compile, naming ``origin``.
    """

    def __init__(self, source: str, *, origin: str = "chat template") -> None:
        import jinja2

        self.source = source
        self.origin = origin
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ConfigError(
                f"{origin}: the chat template is not valid Jinja (line {exc.lineno}: {exc.message})"
            ) from None

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """Render one conversation to prompt text.

        :param messages: the conversation (see :func:`check_messages`).
        :param add_generation_prompt: end with the header of an assistant turn,
            so the model writes the answer.
        :param variables: further template variables: the special tokens
            (``bos_token``, ``eos_token``...), ``tools``, ``enable_thinking``...
        :return: the prompt text (special tokens written out as text).
        :raises RequestError: the messages are malformed, or the template
            refused them (``raise_exception``), with its message.
        """
        import jinja2

        chat = check_messages(messages)
        where = find_invalid_text(variables, "chat_template_kwargs")
        if where is not None:
            raise InvalidFieldError(_not_text(where), field="chat_template_kwargs")
        context = {"tools": None, "documents": None, **variables}
        try:
            return self._template.render(
                messages=chat, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.exceptions.TemplateError as exc:
            raise RequestError(
                f"the chat template ({self.origin}) refused the messages: {exc}"
            ) from None
