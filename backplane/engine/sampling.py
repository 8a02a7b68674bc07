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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from backplane.core.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    :param max_tokens: most tokens to generate (at least 1).
    :param temperature: ``0`` is greedy decoding; higher values flatten the
        distribution.
    :param top_k: keep only the ``top_k`` most likely tokens; ``0`` (or ``-1``)
        turns the filter off.
    :param top_p: nucleus sampling threshold in ``(0, 1]``; ``1`` is off.
    :param min_p: drop tokens less likely than ``min_p`` times the most likely
        one, in ``[0, 1]``; ``0`` is off.
    :param seed: when set, the request's tokens are reproducible regardless of
        which other requests share its batches.
    :param stop_token_ids: generation stops after any of these tokens (the
        token is kept in the output).
    :param ignore_eos: keep generating after the model's end-of-sequence token.
    :raises RequestError: on an out-of-range value, naming the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> RequestError:
            return RequestError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {why}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, (int, np.integer)):
            raise bad("max_tokens", "must be an integer")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
            raise bad("top_k", "must be an integer (0 or -1 turns it off)")
        if self.top_k < -1:
            raise bad("top_k", "must be >= 1, or 0/-1 to turn it off")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]; 1 turns it off")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "must be in [0, 1]; 0 turns it off")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))
        ):
            raise bad("seed", "must be an integer or None")
        if self.seed is not None and not (-(2**63) <= int(self.seed) < 2**63):
            raise bad("seed", "must fit in 64 bits (between -2**63 and 2**63 - 1)")
        stops = self.stop_token_ids
        if stops is None:
            stops = ()
        try:
            stops = tuple(int(t) for t in stops)
        except (TypeError, ValueError):
            raise bad("stop_token_ids", "must be a sequence of integer token ids") from None
        if any(t < 0 for t in stops):
            raise bad("stop_token_ids", "token ids must be >= 0")
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes greedily."""
        return self.temperature == 0.0


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
        temps = np.fromiter((p.temperature for p in params), dtype=np.float32, count=n)
        greedy = temps == 0.0
        all_greedy = bool(greedy.all()) if n else True
        top_k = np.fromiter((p.top_k for p in params), dtype=np.int64, count=n)
        top_p = np.fromiter((p.top_p for p in params), dtype=np.float32, count=n)
        min_p = np.fromiter((p.min_p for p in params), dtype=np.float32, count=n)
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
            remove |= before >= top_p.unsqueeze(1)
            remove[:, 0] = False
        x = x.scatter(1, order, sorted_x.masked_fill(remove, float("-inf")))
    if min_p is not None:
        p = torch.softmax(x, dim=-1)
        threshold = p.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        x = x.masked_fill(p < threshold, float("-inf"))
    return x


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
