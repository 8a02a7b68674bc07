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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from backplane.engine.sampling.greedy import greedy_tokens
from backplane.engine.sampling.logprobs import LogprobsTensors, compute_logprobs
from backplane.engine.sampling.params import SamplingParams
from backplane.engine.sampling.processing import (
    apply_processing,
    apply_token_bitmask,
    host_to_device,
)
from backplane.engine.sampling.rows import SamplingRows

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)

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
    # 23 random bits plus one half need float32's 24 significant bits, so u is exact and
    # strictly inside (0, 1); with 24 bits, (2**24 - 0.5) / 2**24 rounds to 1.0 and its noise
    # to 0, and a token filtered to probability 0 then wins the argmax as 0 / 0 = NaN
    u = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
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
            temperature=host_to_device(temps, device),
            top_k=host_to_device(top_k, device) if (top_k > 0).any() else None,
            top_p=host_to_device(top_p, device) if (top_p < 1.0).any() else None,
            min_p=host_to_device(min_p, device) if (min_p > 0.0).any() else None,
            seeds=host_to_device(np.ascontiguousarray(seeds, dtype=np.int64), device),
            offsets=host_to_device(np.ascontiguousarray(offsets, dtype=np.int64), device),
            greedy=host_to_device(greedy, device) if greedy.any() and not all_greedy else None,
            all_greedy=all_greedy,
        )

    def sample_tensors(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """Pick one token per row from prepared parameters; device work only.

        :param logits: ``[n, vocab]`` logits (any float dtype).
        :param t: from :meth:`prepare` for the same rows.
        :return: ``[n]`` int64 token ids on ``logits.device``.
        """
        if t.all_greedy:
            return greedy_tokens(logits)
        assert t.temperature is not None and t.seeds is not None and t.offsets is not None
        filtered = apply_filters(logits, t.temperature, t.top_k, t.top_p, t.min_p)
        probs = torch.softmax(filtered, dim=-1)
        noise = exponential_noise(t.seeds, t.offsets, probs.shape[-1])
        sampled = (probs / noise).argmax(dim=-1)
        if t.greedy is not None:
            sampled = torch.where(t.greedy, greedy_tokens(logits), sampled)
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
        """Process (penalties, ``min_tokens``, grammar bitmasks), sample, and compute
        logprobs where asked.

        The grammar mask is applied after the penalties and before temperature,
        top-k, top-p and min-p, so the filters see only allowed tokens.

        :param logits: ``[len(rows), vocab]`` raw logits.
        :param rows: the step's rows.
        :return: tokens, and logprobs of the raw distribution when a row asks.
        """
        processed = apply_processing(logits, rows) if rows.processing is not None else logits
        if rows.grammar is not None and len(rows.grammar):
            processed = apply_token_bitmask(processed, rows.grammar)
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
    # finite logits stay finite: a tiny temperature (or a large logit after a penalty) would
    # overflow to inf, and softmax over two infs is NaN; -inf (a suppressed token) stays -inf
    x = (x / t.unsqueeze(1)).clamp(max=_FLOAT32_MAX)
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
