"""Checks on text that comes from users: it must be encodable as UTF-8.

Python strings may hold lone surrogates (``"\\ud800"``, which JSON's ``\\ud800``
escape and ``json.loads`` produce); no tokenizer or UTF-8 encoder takes them.
Every door that accepts text refuses them up front, naming where they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["find_invalid_text", "is_utf8_text"]

#: Containers nested deeper than this are not walked further (a JSON body is far shallower).
_MAX_DEPTH = 64

#: The types :func:`find_invalid_text` looks into.
_WALKED = (str, Mapping, list, tuple)


def is_utf8_text(text: str) -> bool:
    """Whether a string can be encoded as UTF-8 (holds no lone surrogate).

    :param text: any string.
    :return: ``True`` when ``text.encode("utf-8")`` succeeds.
    """
    if text.isascii():  # the common case, without copying the string
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def find_invalid_text(value: Any, where: str) -> str | None:
    """The place of the first string that is not UTF-8 text inside a JSON-like value.

    Walks strings, mapping keys and values, lists and tuples.

    :param value: a string, a mapping, a list or tuple of those, or anything else (not walked).
    :param where: the name of ``value`` (``"messages"``), the start of the place returned.
    :return: ``None`` when every string is valid, else its place (``"messages[0].role"``;
        a mapping key is shown as ``"kwargs.<key>"`` with the key escaped).
    """
    return _find(value, where, 0)


def _find(value: Any, where: str, depth: int) -> str | None:
    if isinstance(value, str):
        return None if is_utf8_text(value) else where
    if depth >= _MAX_DEPTH:
        return None
    if isinstance(value, Mapping):
        for key, item in value.items():
            # an escaped key, so the place itself can be sent back as UTF-8
            name = ascii(key)[1:-1] if isinstance(key, str) else repr(key)
            place = f"{where}.{name}"
            if isinstance(key, str) and not is_utf8_text(key):
                return place
            found = _find(item, place, depth + 1)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        if not any(issubclass(t, _WALKED) for t in set(map(type, value))):
            return None  # e.g. a long list of token ids: one pass at C speed
        for i, item in enumerate(value):
            found = _find(item, f"{where}[{i}]", depth + 1)
            if found is not None:
                return found
    return None
