"""Sampling parameters and the one table of rules that checks them.

:class:`SamplingParams` is what a request asks of the sampler. Every field is
checked by its row of :data:`FIELD_RULES` when the object is built, for the
Python API and the HTTP server alike (the server builds its parameters through
the same table and reports the field an :class:`InvalidFieldError` names), so
both doors accept and refuse the same values with the same message. Limits
that depend on the model (the vocabulary) are checked by :func:`check_for_model`
when the engine takes a request.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backplane.core.errors import InvalidFieldError, RequestError
from backplane.core.text import is_utf8_text
from backplane.engine.sampling.structured import StructuredOutputsParams, as_structured_outputs

#: Temperatures above 0 and below this decode greedily, like ``0``: dividing
#: logits by a smaller one leaves a single token with all the probability
#: anyway, and by a tiny one (``1e-39``) overflows float32 to ``inf`` and NaN.
MIN_TEMPERATURE = 1e-5

#: Largest value of the integer fields the sampler holds in int32 tensors.
_INT32_MAX = 2**31 - 1

#: Largest float32: the real fields become float32 tensors, and a larger value turns to ``inf``.
FLOAT32_MAX = float(np.finfo(np.float32).max)

#: Smallest normal float32 above 0: a smaller divisor overflows ordinary logits to ``inf``.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)

#: Most characters of a refused value that an error message repeats.
_SHOWN_CHARS = 200


class _Invalid(Exception):
    """Raised by a field rule: ``why`` says what the field must be."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _is_integer(v: Any) -> bool:
    # exact: bool is an int subclass, but True is not a token count
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _integer(lo: int, hi: int, why: str) -> Callable[[Any], int]:
    """A rule: an integer (Python or numpy, not bool) in ``[lo, hi]``, returned as ``int``."""

    def rule(v: Any) -> int:
        if not _is_integer(v) or not lo <= int(v) <= hi:
            raise _Invalid(why)
        return int(v)

    return rule


def _real(ok: Callable[[float], bool], why: str) -> Callable[[Any], float]:
    """A rule: a real number (not bool, not a string), within float32's range and ``ok``,
    returned as ``float``."""

    def rule(v: Any) -> float:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Real, np.floating)):
            raise _Invalid(why)
        try:
            f = float(v)
        except OverflowError:  # an int beyond float's range
            raise _Invalid(why) from None
        # the sampler holds it in float32: 1e39 is finite here and inf there
        if not math.isfinite(f) or abs(f) > FLOAT32_MAX or not ok(f):
            raise _Invalid(why)
        return f

    return rule


def _boolean(why: str) -> Callable[[Any], bool]:
    """A rule: ``True`` or ``False`` (``"no"`` and ``1`` are not)."""

    def rule(v: Any) -> bool:
        if not isinstance(v, (bool, np.bool_)):
            raise _Invalid(why)
        return bool(v)

    return rule


def _optional(inner: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A rule: ``None``, or what ``inner`` accepts."""

    def rule(v: Any) -> Any:
        return None if v is None else inner(v)

    return rule


def _token_ids(why: str) -> Callable[[Any], tuple[int, ...]]:
    """A rule: a list, tuple or 1-D integer array of token ids (``None`` = none)."""
    one = _integer(0, _INT32_MAX, why)

    def rule(v: Any) -> tuple[int, ...]:
        if v is None:
            return ()
        if isinstance(v, np.ndarray):
            if v.ndim != 1:
                raise _Invalid(why)
            v = v.tolist()
        if not isinstance(v, (list, tuple)):
            raise _Invalid(why)
        return tuple(one(t) for t in v)

    return rule


def _seed(v: Any) -> int:
    why = "must be None or an integer from -2**63 to 2**64 - 1 (a signed or unsigned 64-bit seed)"
    return _integer(-(2**63), 2**64 - 1, why)(v)


#: Most samples one request may ask for (``SamplingParams.n``).
MAX_N = 128

#: Most top logprobs one request may ask for per token (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20


def _stop_strings(why: str) -> Callable[[Any], tuple[str, ...]]:
    """A rule: a string, or a list / tuple of strings (``None`` = none); each non-empty, short,
    and UTF-8 text."""

    def one(v: Any) -> str:
        # how many and how long: the engine's max_stop_strings / max_stop_string_length
        if not isinstance(v, str) or not v:
            raise _Invalid(why)
        if not is_utf8_text(v):
            raise _Invalid(
                "holds a string that is not UTF-8 text (a lone surrogate such as \\ud800); "
                "send valid Unicode text"
            )
        return v

    def rule(v: Any) -> tuple[str, ...]:
        if v is None:
            return ()
        if isinstance(v, str):
            return (one(v),)
        if not isinstance(v, (list, tuple)):
            raise _Invalid(why)
        return tuple(one(s) for s in v)

    return rule


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    Every field is checked when the object is built (:data:`FIELD_RULES`:
    exact types, ranges); a bad one raises
    :class:`~backplane.core.errors.InvalidFieldError` naming it. Values are
    normalised once (:func:`check_field`): numpy scalars become Python numbers, ``top_k=-1`` becomes
    ``0``, a temperature below :data:`MIN_TEMPERATURE` becomes ``0`` (greedy),
    ``stop_token_ids`` a tuple of ints. Limits that depend on the model (``top_k``
    and stop ids within the vocabulary) are checked when the engine takes the
    request (:func:`check_for_model`).

    :param max_tokens: most tokens to generate (an integer >= 1).
    :param temperature: ``0`` is greedy decoding; higher values flatten the
        distribution. A number from 0 to :data:`FLOAT32_MAX` (the sampler
        divides float32 logits by it); below :data:`MIN_TEMPERATURE` it is greedy.
    :param top_k: keep only the ``top_k`` most likely tokens (at most the
        vocabulary size); ``0`` or ``-1`` turns the filter off.
    :param top_p: nucleus sampling threshold in ``(0, 1]``; ``1`` is off.
    :param min_p: drop tokens less likely than ``min_p`` times the most likely
        one, in ``[0, 1]``; ``0`` is off.
    :param seed: when set, the request's tokens are reproducible regardless of
        which other requests share its batches: any signed or unsigned 64-bit
        integer (``s`` and ``s - 2**64`` are the same seed).
    :param stop_token_ids: generation stops after any of these tokens (the
        token is kept in the output); integer ids >= 0.
    :param ignore_eos: keep generating after the model's end-of-sequence token
        (``True`` or ``False``).
    :param n: samples generated for the prompt (1 to :data:`MAX_N`); each is its
        own engine request (``LLM`` and the server split them; a seeded request's
        sample ``j`` uses ``seed + j``).
    :param stop: strings that end generation when they appear in the text
        (matched across token boundaries, by ``LLM`` / ``AsyncLLM`` on the
        detokenized text); a string or a list of non-empty strings of UTF-8 text.
    :param include_stop_str_in_output: keep the matched stop string at the end
        of the text (``False``: the text ends before it).
    :param min_tokens: EOS and ``stop_token_ids`` cannot be sampled before this
        many tokens were generated (an integer from 0 to ``max_tokens``).
    :param presence_penalty: subtracted once from the logit of every token the
        output already holds (OpenAI semantics), in ``[-2, 2]``; ``0`` is off.
    :param frequency_penalty: subtracted from each token's logit once per time the
        output already holds it, in ``[-2, 2]``; ``0`` is off.
    :param repetition_penalty: tokens of the prompt or the output have positive
        logits divided by it and negative ones multiplied by it (HF / vLLM
        semantics); a number from :data:`FLOAT32_TINY` to :data:`FLOAT32_MAX`,
        ``1`` is off.
    :param logprobs: return the log-probability of each sampled token plus the
        ``logprobs`` most likely ones (0 to :data:`MAX_LOGPROBS`), from the raw
        model distribution (before penalties, temperature and filters);
        ``None`` returns none.
    :param prompt_logprobs: return, for every prompt token after the first, its
        log-probability given the tokens before it plus the ``prompt_logprobs``
        most likely tokens at that position (0 to :data:`MAX_LOGPROBS`; raw model
        distribution); ``None`` returns none. Such a request computes its whole
        prompt (it takes no prefix-cache hits), as in vLLM.
    :param structured_outputs: constrain the output to a JSON schema, any JSON
        object, a regex, a list of choices or an EBNF grammar: a
        :class:`~backplane.engine.sampling.structured.StructuredOutputsParams`
        or a dict of its fields (``{"json": schema}``); ``None`` is off. The
        request finishes (reason ``"stop"``) when the constraint is complete.
    :raises InvalidFieldError: on a value of the wrong type or out of range, naming the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    stop: tuple[str, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        for name in FIELD_RULES:
            value = getattr(self, name)
            checked = check_field(name, value)
            if checked is not value:
                object.__setattr__(self, name, checked)
        if self.min_tokens > self.max_tokens:
            raise InvalidFieldError(
                f"SamplingParams.min_tokens={self.min_tokens} is invalid: must be at most "
                f"max_tokens ({self.max_tokens})",
                field="min_tokens",
            )
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes greedily."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when a presence, frequency or repetition penalty is on."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


#: One rule per :class:`SamplingParams` field: it takes the value given and
#: returns the normalised one, or raises ``_Invalid(why)``. A new field adds a
#: row here (a test checks that every field has one).
FIELD_RULES: dict[str, Callable[[Any], Any]] = {
    "max_tokens": _integer(1, _INT32_MAX, f"must be an integer from 1 to {_INT32_MAX}"),
    "temperature": _real(
        lambda t: t >= 0.0,
        f"must be a number from 0 to {FLOAT32_MAX:.7g} (the largest float32); 0 means greedy, "
        f"and so does anything below {MIN_TEMPERATURE:g}",
    ),
    "top_k": _integer(
        -1, _INT32_MAX, "must be -1 or 0 (off) or an integer from 1 up to the vocabulary size"
    ),
    "top_p": _real(lambda p: 0.0 < p <= 1.0, "must be a number in (0, 1]; 1 turns it off"),
    "min_p": _real(lambda p: 0.0 <= p <= 1.0, "must be a number in [0, 1]; 0 turns it off"),
    "seed": _optional(_seed),
    "stop_token_ids": _token_ids(
        f"must be a list of integer token ids from 0 to {_INT32_MAX} (or None)"
    ),
    "ignore_eos": _boolean("must be True or False"),
    "n": _integer(1, MAX_N, f"must be an integer from 1 to {MAX_N}"),
    "stop": _stop_strings("must be a non-empty string or a list of non-empty strings (or None)"),
    "include_stop_str_in_output": _boolean("must be True or False"),
    "min_tokens": _integer(0, _INT32_MAX, "must be an integer from 0 (off) up to max_tokens"),
    "presence_penalty": _real(
        lambda v: -2.0 <= v <= 2.0, "must be a number in [-2, 2]; 0 turns it off"
    ),
    "frequency_penalty": _real(
        lambda v: -2.0 <= v <= 2.0, "must be a number in [-2, 2]; 0 turns it off"
    ),
    "repetition_penalty": _real(
        lambda v: v >= FLOAT32_TINY,
        f"must be a number from {FLOAT32_TINY:.7g} to {FLOAT32_MAX:.7g} (float32's normal "
        "range); 1 turns it off",
    ),
    "logprobs": _optional(
        _integer(0, MAX_LOGPROBS, f"must be None or an integer from 0 to {MAX_LOGPROBS}")
    ),
    "prompt_logprobs": _optional(
        _integer(0, MAX_LOGPROBS, f"must be None or an integer from 0 to {MAX_LOGPROBS}")
    ),
    # raises InvalidFieldError itself: its message says which part of the constraint is wrong
    "structured_outputs": as_structured_outputs,
}


def check_field(name: str, value: Any) -> Any:
    """Check one :class:`SamplingParams` field by its row of :data:`FIELD_RULES`.

    The one validation of sampling values: :class:`SamplingParams` calls it for
    every field, and the HTTP server for every field a request body sets, so
    both refuse the same values with the same message.

    :param name: the field's name (a key of :data:`FIELD_RULES`).
    :param value: the value given.
    :return: the normalised value (``int`` / ``float`` / ``bool``, tuples for lists).
    :raises InvalidFieldError: naming ``name``, saying what it must be.
    :raises KeyError: ``name`` is not a field.
    """
    try:
        return FIELD_RULES[name](value)
    except _Invalid as exc:
        raise InvalidFieldError(
            f"SamplingParams.{name}={_shown(value)} is invalid: {exc.why}", field=name
        ) from None


def _shown(value: Any) -> str:
    """``repr(value)``, cut short: a refused value may be megabytes long."""
    text = repr(value)
    if len(text) <= _SHOWN_CHARS:
        return text
    return f"{text[: _SHOWN_CHARS - 20]}... ({len(text)} characters)"


def check_for_model(params: SamplingParams, vocab_size: int, request_id: str) -> None:
    """Check the limits of ``params`` that depend on the model: its vocabulary.

    :param params: the request's parameters (already valid on their own).
    :param vocab_size: the model's vocabulary size.
    :param request_id: the request's id, named in the message.
    :raises InvalidFieldError: ``top_k`` above the vocabulary size, or a
        ``stop_token_ids`` entry outside the vocabulary.
    """
    if params.top_k > vocab_size:
        raise InvalidFieldError(
            f"request {request_id!r}: SamplingParams.top_k={params.top_k} is larger than the "
            f"vocabulary ({vocab_size} tokens); use at most {vocab_size}, or 0 / -1 to turn it off",
            field="top_k",
        )
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidFieldError(
            f"request {request_id!r}: SamplingParams.stop_token_ids holds {bad[0]}, outside the "
            f"vocabulary [0, {vocab_size}); use this model's tokenizer's ids",
            field="stop_token_ids",
        )


def seed_as_int64(seed: int) -> int:
    """The signed 64-bit value of a seed given as a signed or unsigned 64-bit integer.

    :param seed: in ``[-2**63, 2**64)`` (what :class:`SamplingParams` accepts).
    :return: the same bits read as int64, so ``s`` and ``s - 2**64`` draw the same numbers.
    """
    return seed - 2**64 if seed >= 2**63 else seed


def as_params_list(
    sampling_params: SamplingParams | Iterable[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    """Broadcast one :class:`SamplingParams` (or ``None`` = defaults) to ``n`` requests.

    :param sampling_params: one set for every request, or one per request.
    :param n: number of requests.
    :return: ``n`` parameter sets.
    :raises RequestError: when a list of the wrong length is given.
    """
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    out = list(sampling_params)
    if len(out) != n:
        raise RequestError(
            f"got {len(out)} SamplingParams for {n} prompts; pass one or one per prompt"
        )
    for p in out:
        if not isinstance(p, SamplingParams):
            raise RequestError(f"expected SamplingParams, got {type(p).__name__}")
    return out
