"""Compiling a request's constraint into a grammar, once per distinct constraint."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

from backplane.core.errors import InvalidFieldError
from backplane.engine.sampling.structured import StructuredOutputsParams
from backplane.engine.structured_output.vocabulary import import_xgrammar

logger = logging.getLogger(__name__)

#: xgrammar's "[time] file.cc:line: " before its message: noise to a client
_SOURCE_PREFIX = re.compile(r"^\[[0-9:.]+\]\s+\S+:\d+:\s*")

#: Compiled grammars kept by default (the least recently used goes first).
DEFAULT_CACHE_SIZE = 256


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices``.

    :param choices: the strings.
    :return: the grammar, ``root ::= "a" | "b" ...`` with each string escaped.
    """
    # JSON string escapes (\", \\, \n, \uXXXX) are the EBNF literal's escapes too
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarCompiler:
    """Compiles :class:`StructuredOutputsParams` for one tokenizer, with an LRU cache.

    Safe to call from any thread (xgrammar compiles without the GIL): the
    server and ``AsyncLLM`` compile on their tokenizer threads, so the engine
    loop finds the grammar in the cache.

    :param info: the ``xgrammar.TokenizerInfo`` of the model
        (:func:`~backplane.engine.structured_output.vocabulary.tokenizer_info`; Any: xgrammar
        ships no type information).
    :param cache_size: most compiled grammars kept.
    """

    def __init__(self, info: Any, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        xgr = import_xgrammar()
        # the cache is ours (keyed by the constraint); xgrammar's own would hold a second copy
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        #: the tokenizer description the grammars are compiled for
        self.info = info
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_size = max(1, int(cache_size))
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec``, from the cache when it was compiled before.

        :param spec: the constraint.
        :return: an ``xgrammar.CompiledGrammar``.
        :raises InvalidFieldError: (field ``structured_outputs``) the schema, regex or
            grammar does not compile; the message says what the backend found wrong.
        """
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        c = self._compiler
        kind = spec.kind
        try:
            if kind == "json":
                return c.compile_json_schema(json.dumps(spec.schema), any_whitespace=True)
            if kind == "json_object":
                # an object, as OpenAI's JSON mode promises (the built-in grammar takes any value)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=True)
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(spec.choice or ()))
            return c.compile_grammar(spec.grammar)
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError and its own types
            what = {
                "json": "JSON schema",
                "json_object": "JSON object schema",
                "regex": "regular expression",
                "choice": "choice list",
                "grammar": "grammar (EBNF, with a root rule)",
            }[kind]
            text = str(exc).strip()
            detail = _SOURCE_PREFIX.sub("", text.splitlines()[0]) if text else type(exc).__name__
            raise InvalidFieldError(
                f"structured_outputs.{kind}: the {what} does not compile: {detail[:500]}; "
                "fix it and send the request again",
                field="structured_outputs",
            ) from None
