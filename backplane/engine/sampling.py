"""Sampling parameters and the batched, on-device sampler.

The sampler turns one logits row per sampling sequence into one token per
row, for the whole batch at once: per-row parameters become small tensors and
every filter (temperature, top-k, top-p, min-p) is one vectorised pass over
``[num_rows, vocab]``. Random numbers come from a counter-based generator
(:func:`exponential_noise`): a pure function of each row's seed and the index
of the token it samples, so a seeded request's tokens do not depend on what
else is in the batch, and sampling needs no host synchronisation and can run
inside a captured CUDA graph.

Filter semantics (the tests' naive reference follows them exactly):

1. ``temperature == 0`` is greedy: the row's token is ``argmax(logits)`` and
   the other filters are ignored. Otherwise logits are divided by the
   temperature.
2. ``top_k > 0`` keeps the ``top_k`` highest logits.
3. ``top_p < 1`` keeps, in descending order of probability (of the
   distribution left by step 2), each token whose preceding tokens' mass is
   below ``top_p``; the most likely token is always kept.
4. ``min_p > 0`` drops tokens whose probability is below ``min_p`` times the
   most likely token's probability.

The remaining logits are sampled with the exponential-race trick
(``argmax(p / E)`` with ``E ~ Exp(1)``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from backplane.core.errors import InvalidFieldError, RequestError

#: Temperatures above 0 and below this decode greedily, like ``0``: dividing
#: logits by a smaller one leaves a single token with all the probability
#: anyway, and by a tiny one (``1e-39``) overflows float32 to ``inf`` and NaN.
MIN_TEMPERATURE = 1e-5

#: Largest value of the integer fields the sampler holds in int32 tensors.
_INT32_MAX = 2**31 - 1


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
    """A rule: a real number (not bool, not a string), finite and ``ok``, returned as ``float``."""

    def rule(v: Any) -> float:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Real, np.floating)):
            raise _Invalid(why)
        try:
            f = float(v)
        except OverflowError:  # an int beyond float's range
            raise _Invalid(why) from None
        if not math.isfinite(f) or not ok(f):
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
    """A rule: a string, or a list / tuple of strings (``None`` = none); each non-empty, short."""

    def one(v: Any) -> str:
        if not isinstance(v, str) or not v or len(v) > 1024:
            raise _Invalid(why)
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
    normalised once: numpy scalars become Python numbers, ``top_k=-1`` becomes
    ``0``, a temperature below :data:`MIN_TEMPERATURE` becomes ``0`` (greedy),
    ``stop_token_ids`` a tuple of ints. Limits that depend on the model (``top_k``
    and stop ids within the vocabulary) are checked when the engine takes the
    request.

    :param max_tokens: most tokens to generate (an integer >= 1).
    :param temperature: ``0`` is greedy decoding; higher values flatten the
        distribution. Any finite number >= 0; below :data:`MIN_TEMPERATURE` it
        is greedy.
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
        detokenized text); a string or a list of non-empty strings.
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
        semantics); a finite number > 0, ``1`` is off.
    :param logprobs: return the log-probability of each sampled token plus the
        ``logprobs`` most likely ones (0 to :data:`MAX_LOGPROBS`), from the raw
        model distribution (before penalties, temperature and filters);
        ``None`` returns none.
    :param prompt_logprobs: return, for every prompt token after the first, its
        log-probability given the tokens before it plus the ``prompt_logprobs``
        most likely tokens at that position (0 to :data:`MAX_LOGPROBS`; raw model
        distribution); ``None`` returns none. Such a request computes its whole
        prompt (it takes no prefix-cache hits), as in vLLM.
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

    def __post_init__(self) -> None:
        for name, rule in FIELD_RULES.items():
            value = getattr(self, name)
            try:
                checked = rule(value)
            except _Invalid as exc:
                raise InvalidFieldError(
                    f"SamplingParams.{name}={value!r} is invalid: {exc.why}", field=name
                ) from None
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
        f"must be a finite number >= 0 (0 means greedy, and so does anything below "
        f"{MIN_TEMPERATURE:g})",
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
    "stop": _stop_strings(
        "must be a non-empty string or a list of non-empty strings of at most 1024 characters "
        "(or None)"
    ),
    "include_stop_str_in_output": _boolean("must be True or False"),
    "min_tokens": _integer(0, _INT32_MAX, "must be an integer from 0 (off) up to max_tokens"),
    "presence_penalty": _real(
        lambda v: -2.0 <= v <= 2.0, "must be a number in [-2, 2]; 0 turns it off"
    ),
    "frequency_penalty": _real(
        lambda v: -2.0 <= v <= 2.0, "must be a number in [-2, 2]; 0 turns it off"
    ),
    "repetition_penalty": _real(lambda v: v > 0.0, "must be a finite number > 0; 1 turns it off"),
    "logprobs": _optional(
        _integer(0, MAX_LOGPROBS, f"must be None or an integer from 0 to {MAX_LOGPROBS}")
    ),
    "prompt_logprobs": _optional(
        _integer(0, MAX_LOGPROBS, f"must be None or an integer from 0 to {MAX_LOGPROBS}")
    ),
}


def seed_as_int64(seed: int) -> int:
    """The signed 64-bit value of a seed given as a signed or unsigned 64-bit integer.

    :param seed: in ``[-2**63, 2**64)`` (what :class:`SamplingParams` accepts).
    :return: the same bits read as int64, so ``s`` and ``s - 2**64`` draw the same numbers.
    """
    return seed - 2**64 if seed >= 2**63 else seed


#: Mask of the low 32 bits; the counter-based generator works on 32-bit words held in int64.
_M32 = 0xFFFFFFFF
#: Multiplier of the 32-bit integer hash (below 2**31, so products of 32-bit words fit in int64).
_MIX = 0x45D9F3B


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche hash of 32-bit words stored in an int64 tensor (values stay < 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MIX) & _M32
    x = x ^ (x >> 16)
    x = (x * _MIX) & _M32
    return x ^ (x >> 16)


def exponential_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """``Exp(1)`` noise that is a pure function of ``(seed, offset, token)``.

    A counter-based generator instead of a stateful one: row ``i`` of the result
    depends only on ``seeds[i]`` and ``offsets[i]`` (the index of the token being
    sampled in its request), so a seeded request draws the same numbers whatever
    else shares its batch, in any step order, without host synchronisation and
    inside a captured CUDA graph.

    :param seeds: ``[n]`` int64 per-row seeds (any int64 value).
    :param offsets: ``[n]`` int64 per-row counters (non-negative).
    :param vocab: noise columns.
    :return: ``[n, vocab]`` float32 samples of ``Exp(1)``.
    """
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    row = _mix32(lo ^ _mix32(hi ^ _mix32((offsets & _M32) ^ 0x2545F491)))
    col = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix32(row.unsqueeze(1) ^ col.unsqueeze(0))
    # 24 random bits fill float32's mantissa exactly; +0.5 keeps u inside (0, 1)
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)


@dataclass
class SamplingTensors:
    """One step's sampling parameters as device tensors (see :meth:`Sampler.prepare`).

    :param temperature: ``[n]`` float32 (0 for greedy rows).
    :param top_k: ``[n]`` int64 (0 = off), or ``None`` when every row is off.
    :param top_p: ``[n]`` float32 (1 = off), or ``None``.
    :param min_p: ``[n]`` float32 (0 = off), or ``None``.
    :param seeds: ``[n]`` int64 per-row seeds.
    :param offsets: ``[n]`` int64 index of the token each row samples in its request.
    :param greedy: ``[n]`` bool, or ``None`` when no row is greedy.
    :param all_greedy: every row is greedy (only ``argmax`` runs; the tensors are ``None``).
    """

    temperature: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    seeds: torch.Tensor | None
    offsets: torch.Tensor | None
    greedy: torch.Tensor | None
    all_greedy: bool


class Sampler:
    """Samples one token per logits row for a whole batch in one vectorised pass.

    Stateless: randomness comes from per-row seeds and counters
    (:func:`exponential_noise`), which the caller owns (the engine gives every
    request a seed: its own ``SamplingParams.seed`` or one drawn at admission).
    """

    def prepare(
        self,
        params: Sequence[SamplingParams],
        seeds: np.ndarray | None,
        offsets: np.ndarray | None,
        device: torch.device | str,
    ) -> SamplingTensors:
        """Turn per-row parameters into device tensors (host work; no device sync).

        :param params: one :class:`SamplingParams` per row.
        :param seeds: ``[n]`` int64 per-row seeds; ``None`` draws them from
            torch's global generator (unreproducible across calls).
        :param offsets: ``[n]`` int64 per-row token indices; ``None`` is all 0.
        :param device: where the logits are.
        :return: the step's :class:`SamplingTensors`.
        """
        device = torch.device(device)
        n = len(params)
        temps, top_k, top_p, min_p = param_arrays(params)
        greedy = temps == 0.0
        all_greedy = bool(greedy.all()) if n else True
        if all_greedy:  # argmax only: nothing to copy to the device
            return SamplingTensors(None, None, None, None, None, None, None, True)
        if seeds is None:
            seeds = torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64).numpy()
        if offsets is None:
            offsets = np.zeros(n, dtype=np.int64)
        return SamplingTensors(
            temperature=_to_device(temps, device),
            top_k=_to_device(top_k, device) if (top_k > 0).any() else None,
            top_p=_to_device(top_p, device) if (top_p < 1.0).any() else None,
            min_p=_to_device(min_p, device) if (min_p > 0.0).any() else None,
            seeds=_to_device(np.ascontiguousarray(seeds, dtype=np.int64), device),
            offsets=_to_device(np.ascontiguousarray(offsets, dtype=np.int64), device),
            greedy=_to_device(greedy, device) if greedy.any() and not all_greedy else None,
            all_greedy=all_greedy,
        )

    def sample_tensors(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """Pick one token per row from prepared parameters; device work only.

        :param logits: ``[n, vocab]`` logits (any float dtype).
        :param t: from :meth:`prepare` for the same rows.
        :return: ``[n]`` int64 token ids on ``logits.device``.
        """
        if t.all_greedy:
            return logits.argmax(dim=-1)
        assert t.temperature is not None and t.seeds is not None and t.offsets is not None
        filtered = apply_filters(logits, t.temperature, t.top_k, t.top_p, t.min_p)
        probs = torch.softmax(filtered, dim=-1)
        noise = exponential_noise(t.seeds, t.offsets, probs.shape[-1])
        sampled = (probs / noise).argmax(dim=-1)
        if t.greedy is not None:
            sampled = torch.where(t.greedy, logits.argmax(dim=-1), sampled)
        return sampled

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seeds: np.ndarray | None = None,
        offsets: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Pick one token per row.

        :param logits: ``[num_rows, vocab]`` logits (any float dtype).
        :param params: one :class:`SamplingParams` per row.
        :param seeds: ``[num_rows]`` int64 per-row seeds (``None``: random ones).
        :param offsets: ``[num_rows]`` int64 index of the token each row samples
            in its request (``None``: 0).
        :return: ``[num_rows]`` int64 token ids on ``logits.device``.
        """
        n = logits.shape[0]
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} logits rows")
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        return self.sample_tensors(logits, self.prepare(params, seeds, offsets, logits.device))

    def sample_rows(self, logits: torch.Tensor, rows: SamplingRows) -> SamplerOutput:
        """Process (penalties, ``min_tokens``), sample, and compute logprobs where asked.

        :param logits: ``[len(rows), vocab]`` raw logits.
        :param rows: the step's rows.
        :return: tokens, and logprobs of the raw distribution when a row asks.
        """
        processed = apply_processing(logits, rows) if rows.processing is not None else logits
        tokens = self.sample(processed, rows.params, rows.seeds, rows.offsets)
        lp = None
        if rows.num_logprobs >= 0 and len(rows):
            lp = compute_logprobs(logits, tokens, rows.num_logprobs)
        return SamplerOutput(tokens, lp)


def apply_filters(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p to a batch of logits rows.

    Greedy rows (``temperature == 0``) are scaled by 1; their filters still
    apply but the caller overrides them with ``argmax``.

    :param logits: ``[n, vocab]``.
    :param temperature: ``[n]`` float.
    :param top_k: ``[n]`` int, ``0`` = off (or ``None`` when every row is off).
    :param top_p: ``[n]`` float, ``1`` = off (or ``None``).
    :param min_p: ``[n]`` float, ``0`` = off (or ``None``).
    :return: float32 ``[n, vocab]`` logits with filtered entries set to ``-inf``.
    """
    x = logits.float()
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    x = x / t.unsqueeze(1)
    vocab = x.shape[-1]
    if top_k is not None or top_p is not None:
        sorted_x, order = x.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_x, dtype=torch.bool)
        if top_k is not None:
            k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
            ranks = torch.arange(vocab, device=x.device)
            remove |= ranks.unsqueeze(0) >= k.unsqueeze(1)
            sorted_x = sorted_x.masked_fill(remove, float("-inf"))
        if top_p is not None:
            p = torch.softmax(sorted_x, dim=-1)
            before = p.cumsum(dim=-1) - p  # mass of strictly more likely tokens
            # top_p == 1 is off: a float32 cumsum can reach 1 before the last token
            remove |= (before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
            remove[:, 0] = False
        x = x.scatter(1, order, sorted_x.masked_fill(remove, float("-inf")))
    if min_p is not None:
        p = torch.softmax(x, dim=-1)
        threshold = p.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        x = x.masked_fill(p < threshold, float("-inf"))
    return x


def param_arrays(
    params: Sequence[SamplingParams],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The per-row filter values of a batch, as host arrays.

    :param params: one :class:`SamplingParams` per row.
    :return: ``(temperature float32, top_k int64, top_p float32, min_p float32)``,
        each ``[len(params)]``; ``top_k`` is 0 where it is off.
    """
    n = len(params)
    temps = np.fromiter((p.temperature for p in params), dtype=np.float32, count=n)
    top_k = np.fromiter((p.top_k for p in params), dtype=np.int64, count=n)
    top_p = np.fromiter((p.top_p for p in params), dtype=np.float32, count=n)
    min_p = np.fromiter((p.min_p for p in params), dtype=np.float32, count=n)
    return temps, top_k, top_p, min_p


@dataclass(frozen=True)
class TokenPairs:
    """``(row, token)`` pairs of a step's rows, flat: one entry per occurrence.

    :param rows: ``[m]`` int64 row of each pair (a row of the logits being processed).
    :param tokens: ``[m]`` int64 token id of each pair.
    """

    rows: np.ndarray
    tokens: np.ndarray


@dataclass(frozen=True)
class LogitsProcessing:
    """What changes a step's logits before sampling (only built when some row asks).

    :param penalty_rows: ``[m]`` int64 rows with a penalty, or ``None`` when none has one.
    :param output: ``(i, token)`` per output token of penalty row ``penalty_rows[i]``
        known on the host (a token may repeat: it is counted).
    :param pending: the penalty rows' output tokens still on the device (an
        asynchronous step's): ``(i, token)`` device tensors, or ``None``.
    :param prompt: ``(i, token)`` per prompt token of penalty row ``penalty_rows[i]``
        whose ``repetition_penalty`` is on.
    :param suppress: ``(row, token)`` pairs that cannot be sampled (``min_tokens``).
    """

    penalty_rows: np.ndarray | None = None
    output: TokenPairs | None = None
    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    prompt: TokenPairs | None = None
    suppress: TokenPairs | None = None


@dataclass(frozen=True)
class PromptLogprobRows:
    """The prompt positions of a step whose logprobs are asked for (``prompt_logprobs``).

    Each is a hidden row of the step (a prompt token of a prefill chunk) whose
    logits give the logprobs of the prompt token after it. The rows join the
    step's logits gather behind the sampling rows; only they and the sampling
    rows go through the LM head.

    :param indices: ``[m]`` int64 flat token rows of the step's hidden states (device).
    :param targets: ``[m]`` int64 the prompt token each row predicts (device).
    :param k: top logprobs per row (the most any of the step's requests asks for).
    """

    indices: torch.Tensor
    targets: torch.Tensor
    k: int

    def __len__(self) -> int:
        return int(self.indices.shape[0])


@dataclass(frozen=True)
class SamplingRows:
    """What a step samples: one row per sampling sequence, in logits-row order.

    :param params: each row's :class:`SamplingParams`.
    :param seeds: ``[n]`` int64 per-row seeds.
    :param offsets: ``[n]`` int64 index of the token each row samples in its request.
    :param processing: penalties and ``min_tokens`` suppression, or ``None`` when no row asks.
    :param num_logprobs: the most top logprobs a row asks for, ``-1`` when none asks.
    :param prompt: prompt positions whose logprobs the step computes too, or ``None``.
    """

    params: Sequence[SamplingParams]
    seeds: np.ndarray
    offsets: np.ndarray
    processing: LogitsProcessing | None = None
    num_logprobs: int = -1
    prompt: PromptLogprobRows | None = None

    def __len__(self) -> int:
        return len(self.params)

    @property
    def needs_eager(self) -> bool:
        """True when a row asks for what the captured sampling graphs do not do."""
        return self.processing is not None or self.num_logprobs >= 0 or self.prompt is not None


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability (vLLM's shape).

    :param logprob: natural log of its probability under the raw model distribution.
    :param rank: 1 for the most likely token, 2 for the next...
    :param decoded_token: the token's text, when a tokenizer is known.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class LogprobsTensors:
    """Logprobs of one step's rows on the device: column 0 is the sampled token.

    :param token_ids: ``[n, 1 + k]`` int64: the sampled token, then the top ``k``.
    :param logprobs: ``[n, 1 + k]`` float32 log-probabilities of those tokens.
    :param ranks: ``[n]`` int64 rank of the sampled token.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


@dataclass
class SamplerOutput:
    """What sampling one step returns.

    :param tokens: ``[n]`` int64 sampled tokens on the device.
    :param logprobs: their logprobs when some row asked (``None`` otherwise).
    :param prompt_logprobs: logprobs of the step's :class:`PromptLogprobRows`, in their
        order (column 0 is the prompt token each row predicts), or ``None``.
    """

    tokens: torch.Tensor
    logprobs: LogprobsTensors | None = None
    prompt_logprobs: LogprobsTensors | None = None


def _pair_index(pairs: TokenPairs, vocab: int, device: torch.device) -> torch.Tensor:
    return _to_device(np.ascontiguousarray(pairs.rows * vocab + pairs.tokens), device)


def apply_processing(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Apply the rows' penalties and ``min_tokens`` suppression, vectorised.

    Token counts come from one ``scatter_add_`` of flat ``(row, token)`` pairs
    into ``[m, vocab]`` for the ``m`` penalty rows only. Order (as vLLM):
    repetition penalty on prompt and output tokens, then frequency and presence
    penalties on output tokens, then suppressed tokens set to ``-inf``.

    :param logits: ``[n, vocab]`` logits.
    :param rows: the rows (``rows.processing`` set).
    :return: float32 ``[n, vocab]`` processed logits (a new tensor).
    """
    x = logits.float().clone()
    proc = rows.processing
    if proc is None:
        return x
    n, vocab = x.shape
    device = x.device
    if proc.penalty_rows is not None and len(proc.penalty_rows):
        m = len(proc.penalty_rows)
        params = [rows.params[i] for i in proc.penalty_rows.tolist()]
        idx = _to_device(np.ascontiguousarray(proc.penalty_rows, dtype=np.int64), device)
        counts = torch.zeros(m * vocab, dtype=torch.int32, device=device)
        if proc.output is not None and len(proc.output.rows):
            flat = _pair_index(proc.output, vocab, device)
            counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        if proc.pending is not None:
            prow, ptok = proc.pending
            flat = prow * vocab + ptok
            counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        counts = counts.view(m, vocab)
        sub = x.index_select(0, idx)
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
        if (rep != 1.0).any():
            seen = counts > 0
            if proc.prompt is not None and len(proc.prompt.rows):
                seen = seen.view(-1).clone()
                seen[_pair_index(proc.prompt, vocab, device)] = True
                seen = seen.view(m, vocab)
            r = rep.to(device).unsqueeze(1)
            penalised = torch.where(sub > 0, sub / r, sub * r)
            sub = torch.where(seen, penalised, sub)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
        sub = sub - freq.to(device).unsqueeze(1) * counts.to(torch.float32)
        sub = sub - pres.to(device).unsqueeze(1) * (counts > 0).to(torch.float32)
        x = x.index_copy(0, idx, sub)
    if proc.suppress is not None and len(proc.suppress.rows):
        x.view(-1)[_pair_index(proc.suppress, vocab, device)] = float("-inf")
    return x


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> LogprobsTensors:
    """Logprobs of the given tokens and the top ``k``, from the raw logits.

    ``log_softmax`` in float32 over every row at once, one ``gather`` and one
    ``topk``: used for sampled tokens and for prompt tokens alike.

    :param logits: ``[n, vocab]`` raw model logits.
    :param tokens: ``[n]`` the tokens whose logprob and rank column 0 holds (the sampled
        ones, or the prompt token each row predicts).
    :param k: top logprobs per row (the most any row asks for).
    :return: the step's :class:`LogprobsTensors` (device work only, no host sync).
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, tokens.unsqueeze(1))
    ranks = (lp > picked).sum(dim=-1) + 1
    ids, vals = tokens.unsqueeze(1), picked
    if k > 0:
        top_vals, top_ids = lp.topk(k, dim=-1)
        ids = torch.cat([ids, top_ids], dim=1)
        vals = torch.cat([vals, top_vals], dim=1)
    return LogprobsTensors(ids, vals, ranks)


def logprob_dicts(
    token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray, ks: Sequence[int | None]
) -> list[dict[int, Logprob] | None]:
    """Per row, ``{token_id: Logprob}`` of the sampled token and the row's top ``k``.

    :param token_ids: ``[n, 1 + K]`` host copy of :attr:`LogprobsTensors.token_ids`.
    :param logprobs: ``[n, 1 + K]`` host copy of the logprobs.
    :param ranks: ``[n]`` ranks of the sampled tokens.
    :param ks: each row's ``SamplingParams.logprobs`` (``None``: the row gets ``None``).
    :return: one dict (or ``None``) per row.
    """
    out: list[dict[int, Logprob] | None] = []
    for i, k in enumerate(ks):
        if k is None:
            out.append(None)
            continue
        ids = token_ids[i].tolist()
        vals = logprobs[i].tolist()
        d = {ids[0]: Logprob(vals[0], int(ranks[i]))}
        for j in range(1, k + 1):
            d.setdefault(ids[j], Logprob(vals[j], j))
        out.append(d)
    return out


def _to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(arr)
    return t.to(device, non_blocking=True) if device.type != "cpu" else t


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
