"""Sampling parameters and the batched, on-device sampler.

The sampler turns one logits row per sampling sequence into one token per
row, for the whole batch at once: per-row parameters become small tensors and
every filter (temperature, top-k, top-p, min-p) is one vectorised pass over
``[num_rows, vocab]``. The only per-row work is drawing random numbers for rows
whose request carries a ``seed`` (each such request owns a
:class:`torch.Generator`, so its tokens do not depend on what else is in the
batch); unseeded rows share one draw from the global generator.

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
(``argmax(p / E)`` with ``E ~ Exp(1)``), which needs no host synchronisation.
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

    def make_generator(self, device: torch.device | str) -> torch.Generator | None:
        """Return a generator seeded with :attr:`seed` on ``device`` (``None`` without a seed)."""
        if self.seed is None or self.is_greedy:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(int(self.seed))
        return g


class Sampler:
    """Samples one token per logits row for a whole batch in one vectorised pass.

    Stateless apart from scratch: per-request generators are owned by the
    caller and passed in per step.
    """

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> torch.Tensor:
        """Pick one token per row.

        :param logits: ``[num_rows, vocab]`` logits (any float dtype).
        :param params: one :class:`SamplingParams` per row.
        :param generators: one generator (or ``None``) per row, from
            :meth:`SamplingParams.make_generator`; rows with ``None`` use the
            global generator.
        :return: ``[num_rows]`` int64 token ids on ``logits.device``.
        """
        n = logits.shape[0]
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} logits rows")
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        temps = np.fromiter((p.temperature for p in params), dtype=np.float32, count=n)
        greedy = temps == 0.0
        if greedy.all():
            return logits.argmax(dim=-1)
        top_k = np.fromiter((p.top_k for p in params), dtype=np.int64, count=n)
        top_p = np.fromiter((p.top_p for p in params), dtype=np.float32, count=n)
        min_p = np.fromiter((p.min_p for p in params), dtype=np.float32, count=n)
        filtered = apply_filters(
            logits,
            _to_device(temps, logits.device),
            _to_device(top_k, logits.device) if (top_k > 0).any() else None,
            _to_device(top_p, logits.device) if (top_p < 1.0).any() else None,
            _to_device(min_p, logits.device) if (min_p > 0.0).any() else None,
        )
        probs = torch.softmax(filtered, dim=-1)
        noise = torch.empty_like(probs).exponential_()
        if generators is not None:
            for i, g in enumerate(generators):
                if g is not None:
                    noise[i].exponential_(generator=g)
        sampled = (probs / noise).argmax(dim=-1)
        if greedy.any():
            greedy_t = _to_device(greedy, logits.device)
            sampled = torch.where(greedy_t, logits.argmax(dim=-1), sampled)
        return sampled


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
