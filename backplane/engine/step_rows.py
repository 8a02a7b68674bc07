"""What the engine loop hands the sampler for one step, built from its requests.

:func:`sampling_rows` turns the sampling requests of a step into
:class:`~backplane.engine.sampling.SamplingRows` (parameters, seeds, token
offsets, penalty and ``min_tokens`` inputs, logprob counts); :func:`prompt_rows`
picks the prompt positions whose logprobs the step computes too. Both do a few
numpy operations per step and O(1) Python work per request that asks.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

import numpy as np
import torch

from backplane.engine.outputs import PromptLaunch
from backplane.engine.request import Request
from backplane.engine.sampling import (
    GrammarBitmask,
    LogitsProcessing,
    PromptLogprobRows,
    SamplingParams,
    SamplingRows,
    TokenPairs,
)
from backplane.engine.sched import ScheduledSeq
from backplane.engine.worker.inputs import BatchInputs

__all__ = ["prompt_rows", "sampling_rows"]


class _RowFacts:
    """What a step's rows take from their requests that does not change while they live.

    In a steady decode batch the same requests sample step after step, so these are
    gathered once per batch composition instead of once per step.
    """

    __slots__ = ("reqs", "params", "seeds", "num_logprobs", "min_tokens", "penalty_rows")

    def __init__(self, reqs: tuple[Request, ...]) -> None:
        n = len(reqs)
        self.reqs = reqs
        self.params = [r.sampling_params for r in reqs]
        # the seed is drawn when the request is added, before it is ever scheduled
        self.seeds = np.fromiter((r.sampling_seed for r in reqs), np.int64, n)
        lp = np.fromiter(
            (-1 if p.logprobs is None else p.logprobs for p in self.params), np.int64, n
        )
        self.num_logprobs = int(lp.max()) if n else -1
        self.min_tokens = np.fromiter((p.min_tokens for p in self.params), np.int64, n)
        self.penalty_rows = np.flatnonzero(
            np.fromiter((p.has_penalties for p in self.params), np.bool_, n)
        )


# The facts of the last step's rows (one entry: consecutive steps share their requests).
_last_facts: _RowFacts | None = None


def _row_facts(reqs: Sequence[Request]) -> _RowFacts:
    """The :class:`_RowFacts` of ``reqs``, reused while the same requests sample in the same
    order (a tuple of the same objects compares equal by identity, element by element)."""
    global _last_facts
    key = tuple(reqs)
    facts = _last_facts
    if facts is None or facts.reqs != key:
        facts = _last_facts = _RowFacts(key)
    return facts


def sampling_rows(
    reqs: Sequence[Request],
    pending: torch.Tensor | None,
    prompt: PromptLogprobRows | None = None,
    grammar: GrammarBitmask | None = None,
) -> SamplingRows:
    """The step's sampling rows, one per request, in order.

    :param reqs: the requests that sample, in the step's row order.
    :param pending: the tokens of the step still in flight, on the device (a request
        whose last token is a placeholder has its value there, at ``pending_row``).
    :param prompt: prompt positions whose logprobs the step computes too.
    :param grammar: the allowed tokens of the rows with a grammar (structured output).
    :return: the rows.
    """
    n = len(reqs)
    facts = _row_facts(reqs)
    # the index of the token being sampled: placeholders count, so it is exact in async runs
    offsets = np.fromiter((r.num_output_tokens for r in reqs), np.int64, n)
    return SamplingRows(
        list(facts.params),
        facts.seeds.copy(),
        offsets,
        processing=_processing(
            reqs,
            facts.params,
            offsets,
            pending,
            min_tokens=facts.min_tokens,
            penalty_rows=facts.penalty_rows,
        ),
        num_logprobs=facts.num_logprobs,
        prompt=prompt,
        grammar=grammar,
    )


def _processing(
    reqs: Sequence[Request],
    params: Sequence[SamplingParams],
    offsets: np.ndarray,
    pending_tokens: torch.Tensor | None,
    *,
    min_tokens: np.ndarray | None = None,
    penalty_rows: np.ndarray | None = None,
) -> LogitsProcessing | None:
    """The step's penalty and ``min_tokens`` inputs, or ``None`` when no row asks.

    Host work is a few array concatenations over the rows that ask; the
    counting happens on the device (:func:`~backplane.engine.sampling.apply_processing`).

    :param min_tokens: each row's ``min_tokens`` (default: read from ``params``).
    :param penalty_rows: the rows with a penalty on (default: read from ``params``).
    """
    n = len(reqs)
    if min_tokens is None:
        min_tokens = np.fromiter((p.min_tokens for p in params), np.int64, n)
    if penalty_rows is None:
        penalty_rows = np.flatnonzero(np.fromiter((p.has_penalties for p in params), np.bool_, n))
    suppress_rows = np.flatnonzero(offsets < min_tokens)
    if not len(suppress_rows) and not len(penalty_rows):
        return None
    suppress = None
    if len(suppress_rows):
        stops = [np.fromiter(reqs[i].stop_token_ids, np.int64) for i in suppress_rows]
        suppress = _pairs(suppress_rows, stops)
    output = prompt = pending = None
    if len(penalty_rows):
        penalty_rows = penalty_rows.copy()
        prs = [reqs[i] for i in penalty_rows]
        # an asynchronous step's token is a placeholder here; its value is on the device
        has_pending = np.fromiter((r.has_pending_token for r in prs), np.bool_, len(prs))
        outs = [
            r.output_token_ids[: r.num_output_tokens - int(p)]
            for r, p in zip(prs, has_pending, strict=True)
        ]
        output = _pairs(np.arange(len(prs)), outs)
        if has_pending.any():
            assert pending_tokens is not None
            which = np.flatnonzero(has_pending)
            src = np.fromiter((prs[i].pending_row for i in which), np.int64, len(which))
            dev = pending_tokens.device
            pending = (
                torch.from_numpy(which).to(dev),
                pending_tokens.index_select(0, torch.from_numpy(src).to(dev)),
            )
        rep_on = [i for i, r in enumerate(prs) if r.sampling_params.repetition_penalty != 1.0]
        if rep_on:
            prompt = _pairs(np.array(rep_on), [prs[i].prompt_token_ids for i in rep_on])
    return LogitsProcessing(
        penalty_rows=penalty_rows if len(penalty_rows) else None,
        output=output,
        pending=pending,
        prompt=prompt,
        suppress=suppress,
    )


def _pairs(rows: np.ndarray, token_lists: Sequence[np.ndarray]) -> TokenPairs:
    """Flat ``(row, token)`` pairs: ``rows[i]`` once per token of ``token_lists[i]``."""
    lens = np.fromiter((len(t) for t in token_lists), np.int64, len(token_lists))
    tokens = (
        np.concatenate(token_lists).astype(np.int64, copy=False)
        if len(token_lists)
        else np.zeros(0, np.int64)
    )
    return TokenPairs(np.repeat(np.asarray(rows, dtype=np.int64), lens), tokens)


def prompt_rows(
    wanted: Set[Request], scheduled: Sequence[ScheduledSeq], inputs: BatchInputs
) -> PromptLaunch | None:
    """The step's prompt positions whose logprobs are still wanted, or ``None``.

    A sequence of a request asking for ``prompt_logprobs`` contributes every
    prompt position of its chunk that predicts a prompt token (the last
    prompt token predicts the first output, which is sampled as usual) and
    is not known yet; Python work is per such sequence, rows are numpy ranges.

    :param wanted: live requests whose prompt logprobs are not all computed yet.
    :param scheduled: the step's sequences.
    :param inputs: the step's inputs (where each sequence's first token row is).
    :return: the rows and where their results go, or ``None``.
    """
    if not wanted:
        return None
    picked = [i for i, s in enumerate(scheduled) if s.request in wanted]
    if not picked:
        return None
    starts = inputs.first_token_rows(np.asarray(picked, dtype=np.int64))
    entries: list[tuple[Request, int, int]] = []
    rows: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    k = 0
    offset = 0
    for i, start in zip(picked, starts.tolist(), strict=True):
        s = scheduled[i]
        req = s.request
        state = req.prompt_logprobs
        c = s.num_cached_tokens
        lo = max(c, state.done)
        hi = min(c + s.num_new_tokens, state.num_positions)
        if hi <= lo:
            continue
        rows.append(np.arange(start + lo - c, start + hi - c, dtype=np.int64))
        targets.append(req.token_buffer[lo + 1 : hi + 1])
        entries.append((req, lo, offset))
        offset += hi - lo
        k = max(k, state.k)
    if not entries:
        return None
    device = inputs.logits_indices.device
    index = torch.from_numpy(np.concatenate(rows))
    target = torch.from_numpy(np.concatenate(targets).astype(np.int64))
    if device.type != "cpu":
        index = index.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
    return PromptLaunch(PromptLogprobRows(index, target, k), entries)
