"""Tokenizers: a ``tokenizers`` tokenizer with the special tokens and chat template of its model.

:class:`TextTokenizer` is what a loaded model's ``tokenizer`` is: ``encode(text).ids``
and ``decode(ids)`` as in the ``tokenizers`` library (every other attribute is
the wrapped tokenizer's), plus the named special tokens (``bos_token``,
``eos_token``...) and the chat template. :func:`load_hf_tokenizer` reads a Hugging
Face folder: ``tokenizer.json``, then ``tokenizer_config.json`` (special tokens,
added tokens, the chat template) and ``chat_template.jinja``. GGUF files build
theirs in :mod:`backplane.models.gguf.tokenizer`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from backplane.core.errors import ConfigError, InvalidFieldError, RequestError
from backplane.core.text import is_utf8_text
from backplane.models.chat import ChatTemplate, Message

logger = logging.getLogger(__name__)

#: The named special tokens a chat template may use, as transformers names them.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def byte_alphabet() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: byte value -> the character that spells it.

    Printable bytes map to themselves, the rest to code points above 255, so
    every byte is one visible character (byte-level BPE vocabularies are
    written in it).
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


class TextTokenizer:
    """A model's tokenizer: text <-> token ids, its special tokens and its chat template.

    :param tokenizer: a ``tokenizers.Tokenizer`` (vocabulary, pre-tokenizer,
        added tokens and post-processor already set).
    :param special_tokens: ``{"bos_token": "<s>", "eos_token": ...}`` (absent
        names have none).
    :param chat_template: the compiled chat template, or ``None``.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        special_tokens: dict[str, str] | None = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self.backend = tokenizer
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v}
        self.chat_template = chat_template

    def __getattr__(self, name: str) -> Any:
        # Everything else (token_to_id, get_vocab_size, save...) is the wrapped tokenizer's.
        if name == "backend":
            raise AttributeError(name)
        return getattr(self.backend, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        """Tokenize ``text``.

        :param text: the text; special tokens written in it are matched whole.
        :param add_special_tokens: apply the post-processor (e.g. a leading bos).
        :return: a ``tokenizers.Encoding`` (``.ids``).
        :raises InvalidFieldError: ``text`` is not UTF-8 text (field ``"prompt"``).
        """
        if isinstance(text, str) and not is_utf8_text(text):
            # the backend would raise a bare TypeError ("TextInputSequence must be str")
            raise InvalidFieldError(
                "the prompt holds a string that is not UTF-8 text (a lone surrogate such as "
                "\\ud800); pass valid Unicode text",
                field="prompt",
            )
        return self.backend.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Detokenize ``ids``, leaving special tokens out unless asked."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, name: str) -> int | None:
        """The id of special token ``name`` (``"eos_token"``...), or ``None``."""
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """Render a conversation with the model's chat template.

        :param messages: ``[{"role": "user", "content": "..."}, ...]``.
        :param add_generation_prompt: end with an open assistant turn.
        :param variables: further template variables (``enable_thinking``, ``tools``...).
        :return: the prompt text; encode it with ``add_special_tokens=False``
            (the template writes the special tokens itself).
        :raises RequestError: the model has no chat template, or the template
            refused the messages.
        """
        if self.chat_template is None:
            raise RequestError(
                "this model has no chat template (none in its tokenizer_config.json, "
                "chat_template.jinja or GGUF metadata); use generate() with a plain prompt"
            )
        return self.chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **variables},
        )

    def encode_chat(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True, **variables: Any
    ) -> list[int]:
        """Render a conversation and tokenize it (as transformers' ``apply_chat_template``).

        :return: the prompt's token ids.
        :raises RequestError: as :meth:`apply_chat_template`.
        """
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **variables
        )
        return list(self.encode(text, add_special_tokens=False).ids)


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _chat_template_source(root: Path, config: dict[str, Any]) -> tuple[str, str] | None:
    """The chat template text and where it came from, or ``None``."""
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    value = config.get("chat_template")
    origin = str(root / "tokenizer_config.json")
    if isinstance(value, list):
        # Several named templates: the one called "default" is the chat template.
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if isinstance(value, str) and value:
        return value, origin
    return None


def _add_config_tokens(tokenizer: Any, config: dict[str, Any]) -> None:
    """Add the added tokens and named special tokens ``tokenizer_config.json`` lists.

    ``tokenizer.json`` normally has them already; ones it lacks would otherwise
    be cut into pieces when written in text.
    """
    from tokenizers import AddedToken

    present = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    new: list[Any] = []
    decoder = config.get("added_tokens_decoder") or {}
    for spec in decoder.values():
        content = _token_text(spec)
        if content is None or content in present:
            continue
        new.append(
            AddedToken(
                content,
                single_word=bool(spec.get("single_word", False)),
                lstrip=bool(spec.get("lstrip", False)),
                rstrip=bool(spec.get("rstrip", False)),
                normalized=bool(spec.get("normalized", not spec.get("special", False))),
                special=bool(spec.get("special", False)),
            )
        )
        present.add(content)
    for name in SPECIAL_TOKEN_NAMES:
        content = _token_text(config.get(name))
        if content is not None and content not in present:
            new.append(AddedToken(content, normalized=False, special=True))
            present.add(content)
    special = [t for t in new if t.special]
    plain = [t for t in new if not t.special]
    if special:
        tokenizer.add_special_tokens(special)
    if plain:
        tokenizer.add_tokens(plain)


def load_hf_tokenizer(path: str | os.PathLike) -> TextTokenizer | None:
    """Load the tokenizer of a Hugging Face model folder.

    Reads ``tokenizer.json`` with the ``tokenizers`` library, then
    ``tokenizer_config.json`` (named special tokens, added tokens, chat
    template) and ``chat_template.jinja`` (which takes precedence over the
    template in ``tokenizer_config.json``) when present.

    :param path: the model folder.
    :return: the tokenizer, or ``None`` (with a warning) when there is no ``tokenizer.json``.
    :raises ConfigError: a tokenizer file that cannot be read, naming it.
    """
    from tokenizers import Tokenizer

    root = Path(path)
    f = root / "tokenizer.json"
    if not f.is_file():
        logger.warning("%s has no tokenizer.json; prompts must be given as token ids", path)
        return None
    try:
        tok = Tokenizer.from_file(str(f))
    except Exception as exc:  # the Rust library raises plain Exceptions
        raise ConfigError(f"{f} cannot be read as a tokenizer: {exc}") from None
    cfg_file = root / "tokenizer_config.json"
    config = _read_json(cfg_file) if cfg_file.is_file() else {}
    _add_config_tokens(tok, config)
    special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    source = _chat_template_source(root, config)
    template = None if source is None else ChatTemplate(source[0], origin=source[1])
    return TextTokenizer(
        tok, special_tokens={k: v for k, v in special.items() if v}, chat_template=template
    )
