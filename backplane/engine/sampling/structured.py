"""What a request asks of structured output: :class:`StructuredOutputsParams`.

One constraint per request, named as vLLM names them: a JSON schema
(``json``), any JSON object (``json_object``), a regular expression
(``regex``), one of a list of strings (``choice``) or an EBNF grammar
(``grammar``). The values are checked for shape here; whether a schema, a
regex or a grammar compiles is checked by the grammar backend
(``backplane.engine.structured_output``) when the request is taken.
"""

from __future__ import annotations

import json as _json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from backplane.core.errors import InvalidFieldError

#: The constraint kinds, in the order they are named in messages.
KINDS: tuple[str, ...] = ("json", "regex", "choice", "grammar", "json_object")


def _problem(json: Any, regex: Any, choice: Any, grammar: Any, json_object: Any) -> str | None:
    """Why these values are not one valid constraint, or ``None`` when they are."""
    if json is not None:
        if isinstance(json, str):
            try:
                parsed = _json.loads(json)
            except ValueError as exc:
                return f"json is not valid JSON ({exc}); pass a JSON schema as a dict or a string"
            if not isinstance(parsed, (dict, bool)):
                return "json must be a JSON schema: an object (or true / false)"
        elif not isinstance(json, (dict, bool)):
            return (
                f"json must be a JSON schema as a dict or a JSON string, not {type(json).__name__}"
            )
    if regex is not None and (not isinstance(regex, str) or not regex):
        return "regex must be a non-empty string (a regular expression)"
    if choice is not None:
        if not isinstance(choice, (list, tuple)) or not choice:
            return "choice must be a non-empty list of strings"
        if not all(isinstance(c, str) for c in choice):
            return "choice must hold strings only"
    if grammar is not None and (not isinstance(grammar, str) or not grammar.strip()):
        return "grammar must be a non-empty string (an EBNF grammar with a root rule)"
    if not isinstance(json_object, bool):
        return "json_object must be True or False"
    given = [
        name
        for name, v in zip(KINDS, (json, regex, choice, grammar, json_object), strict=True)
        if v is not None and v is not False
    ]
    if len(given) != 1:
        what = "none" if not given else ", ".join(given)
        return f"exactly one of {', '.join(KINDS)} must be set (got {what})"
    return None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the text a request generates (vLLM's ``structured_outputs``).

    Exactly one field is set. Generation stops when the constraint is complete
    (the grammar accepts nothing more), with finish reason ``"stop"``.

    :param json: a JSON schema, as a dict or a JSON string: the output is a JSON
        value that the schema accepts.
    :param regex: a regular expression the whole output matches.
    :param choice: the output is exactly one of these strings.
    :param grammar: an EBNF grammar (the GBNF dialect xgrammar reads, with a
        ``root`` rule) the output is a sentence of.
    :param json_object: ``True``: the output is any JSON object
        (``response_format={"type": "json_object"}``).
    :raises InvalidFieldError: (field ``structured_outputs``) none or several
        set, or a value of the wrong shape.
    """

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    #: the canonical form of the constraint, for caching compiled grammars
    key: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        why = _problem(self.json, self.regex, self.choice, self.grammar, self.json_object)
        if why is not None:
            raise InvalidFieldError(
                f"structured_outputs is invalid: {why}", field="structured_outputs"
            )
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        object.__setattr__(self, "key", self._canonical())

    def _canonical(self) -> tuple[str, str]:
        if self.json is not None:
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            # key order is kept: it is the order the output's properties follow
            return ("json", _json.dumps(schema, separators=(",", ":")))
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", _json.dumps(list(self.choice)))
        if self.grammar is not None:
            return ("grammar", self.grammar)
        return ("json_object", "")

    @property
    def kind(self) -> str:
        """The constraint's kind: ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"`` or
        ``"json_object"``."""
        return self.key[0]

    @property
    def schema(self) -> dict[str, Any] | bool | None:
        """The JSON schema as a Python value (``json`` parsed when given as a string), or
        ``None`` for the other kinds."""
        if self.json is None:
            return None
        return _json.loads(self.json) if isinstance(self.json, str) else self.json

    def __hash__(self) -> int:
        # a schema dict is unhashable: hash the canonical form instead
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StructuredOutputsParams):
            return NotImplemented
        return self.key == other.key


def as_structured_outputs(value: Any) -> StructuredOutputsParams | None:
    """Take ``structured_outputs`` as given to :class:`SamplingParams` or a request body.

    :param value: ``None``, a :class:`StructuredOutputsParams`, or a mapping of its
        fields (``{"json": {...}}``, ``{"regex": "..."}``...).
    :return: the parameters, or ``None`` when no constraint is asked for.
    :raises InvalidFieldError: (field ``structured_outputs``) an unknown key, or values that
        are not one valid constraint.
    """
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, Mapping):
        raise InvalidFieldError(
            f"structured_outputs must be a StructuredOutputsParams or a dict with one of "
            f"{', '.join(KINDS)}, not {type(value).__name__}",
            field="structured_outputs",
        )
    known = {f.name for f in fields(StructuredOutputsParams) if f.init}
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise InvalidFieldError(
            f"structured_outputs has an unknown key {unknown[0]!r}; use one of {', '.join(KINDS)}",
            field="structured_outputs",
        )
    # None values are how JSON bodies say "not set" (vLLM's clients send every key)
    given = {k: v for k, v in value.items() if v is not None}
    if given.get("json_object") is None:
        given.pop("json_object", None)
    return StructuredOutputsParams(**given)
