"""Rejection sampling of speculative drafts: keep the longest accepted prefix, exactly.

A sequence with ``d`` draft tokens ``x_0 .. x_{d-1}`` is verified from the
target's logits at ``d + 1`` positions (``p_0 .. p_d``: position ``j`` predicts
the token after ``x_{j-1}``). Draft ``j`` is accepted with probability
``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection the token is drawn from
``norm(max(0, p_j - q_j))`` and the rest is dropped; when every draft is
accepted one more token is drawn from ``p_d``. The tokens that come out are
distributed exactly as tokens sampled one by one from the target.

Proposers without a distribution (n-gram prompt lookup) propose a point mass
``q_j = delta(x_j)``: then accepting with probability ``p_j(x_j)`` and drawing
from ``p_j`` without ``x_j`` on rejection is the same as drawing ``y_j ~ p_j``
and accepting when ``y_j == x_j``. That is how it is computed here, with the
sampler's own counter-based noise at each token's index in its request, so a
seeded request speculating with n-gram drafts samples exactly the tokens it
samples without speculation. Greedy rows accept while the target's argmax
equals the draft, then take the target's argmax.

The target's distribution is the sampler's (temperature, top-k, top-p,
min-p, :func:`~backplane.engine.sampling.sampler.apply_filters`). A grammar's
mask is applied first, as the sampler does, with one mask per position: the
grammar's state after the drafts before it. Other logits processing that
depends on earlier tokens (penalties, ``min_tokens``) is not applied here, so
the engine proposes no drafts for requests that use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from backplane.engine.sampling.greedy import greedy_tokens
from backplane.engine.sampling.params import SamplingParams
from backplane.engine.sampling.processing import apply_token_bitmask, host_to_device
from backplane.engine.sampling.rows import GrammarBitmask
from backplane.engine.sampling.sampler import apply_filters, exponential_noise, param_arrays

__all__ = ["RejectionOutput", "rejection_sample", "uniform_noise"]

#: Mixed into the seeds of the acceptance draws so they are independent of the token noise.
_ACCEPT_SALT = 0x5DEECE66D


@dataclass
class RejectionOutput:
    """The verified tokens of a batch of speculating sequences.

    :param tokens: ``[n, K + 1]`` int64: row ``i`` holds ``num_accepted[i]`` accepted drafts,
        then the one token drawn from the target, then ``-1``.
    :param num_accepted: ``[n]`` int64 drafts accepted per row (``0 .. num_drafts[i]``).
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor


def uniform_noise(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``Uniform(0, 1)`` draws that are a pure function of ``(seed, offset)``.

    ``exp(-E)`` with ``E ~ Exp(1)`` is uniform; the seeds are salted so these draws
    are independent of the token noise of the same ``(seed, offset)``.

    :param seeds: ``[n]`` int64 per-row seeds.
    :param offsets: ``[n]`` int64 per-row counters.
    :return: ``[n]`` float32 in ``(0, 1)``.
    """
    return torch.exp(-exponential_noise(seeds ^ _ACCEPT_SALT, offsets, 1)[:, 0])


def rejection_sample(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: np.ndarray,
    params: Sequence[SamplingParams],
    seeds: np.ndarray,
    offsets: np.ndarray,
    draft_probs: torch.Tensor | None = None,
    grammar: GrammarBitmask | None = None,
) -> RejectionOutput:
    """Verify the drafts of a batch of sequences against the target's logits.

    :param target_logits: ``[n, K + 1, vocab]`` raw logits; row ``i`` position ``j``
        is the target's prediction after the context and ``j`` drafts. Positions
        past ``num_drafts[i]`` are ignored.
    :param draft_tokens: ``[n, K]`` int64 draft tokens (entries past ``num_drafts[i]``
        ignored).
    :param num_drafts: ``[n]`` host int64, drafts per row (``0 .. K``).
    :param params: one :class:`SamplingParams` per row.
    :param seeds: ``[n]`` host int64 per-row seeds (the request's sampling seed).
    :param offsets: ``[n]`` host int64, the index in its request of the token position 0
        samples (its output length); position ``j`` draws with counter ``offsets[i] + j``.
    :param draft_probs: ``[n, K, vocab]`` the draft's distributions ``q``, or ``None``
        for point-mass proposals (n-gram).
    :param grammar: the allowed tokens of constrained positions, or ``None``; its rows
        index the flattened ``[n * (K + 1)]`` positions (row ``i`` position ``j`` is
        ``i * (K + 1) + j``). Applied to the raw logits, before the filters; the drafts
        of a constrained row must be allowed by its masks (a refused draft is rejected).
    :return: the :class:`RejectionOutput`.
    :raises ValueError: when the shapes do not agree.
    """
    n, width, vocab = target_logits.shape
    k = width - 1
    if draft_tokens.shape != (n, k) or len(params) != n or len(num_drafts) != n:
        raise ValueError(
            f"target_logits {tuple(target_logits.shape)} needs draft_tokens of shape "
            f"({n}, {k}) and {n} params / num_drafts, got {tuple(draft_tokens.shape)}, "
            f"{len(params)}, {len(num_drafts)}"
        )
    if draft_probs is not None and draft_probs.shape != (n, k, vocab):
        raise ValueError(f"draft_probs must be ({n}, {k}, {vocab}), got {tuple(draft_probs.shape)}")
    device = target_logits.device
    if n == 0:
        empty = torch.empty(0, width, dtype=torch.int64, device=device)
        return RejectionOutput(empty, torch.empty(0, dtype=torch.int64, device=device))
    flat = target_logits.reshape(n * width, vocab)
    if grammar is not None and len(grammar):
        flat = apply_token_bitmask(flat, grammar)
    drafts = draft_tokens.to(device=device, dtype=torch.int64)
    pos = torch.arange(width, device=device, dtype=torch.int64)
    nd = host_to_device(np.ascontiguousarray(num_drafts, dtype=np.int64), device)
    in_draft = pos[:k].unsqueeze(0) < nd.unsqueeze(1)  # [n, K]

    temps, top_k, top_p, min_p = param_arrays(params)
    greedy = temps == 0.0
    argmax = greedy_tokens(flat).view(n, width)
    if greedy.all():
        sampled = argmax
        accept = sampled[:, :k] == drafts
        choice = sampled
    else:
        rep = np.repeat
        filtered = apply_filters(
            flat,
            host_to_device(rep(temps, width), device),
            host_to_device(rep(top_k, width), device) if (top_k > 0).any() else None,
            host_to_device(rep(top_p, width), device) if (top_p < 1.0).any() else None,
            host_to_device(rep(min_p, width), device) if (min_p > 0.0).any() else None,
        )
        probs = torch.softmax(filtered, dim=-1)
        seeds_t = host_to_device(np.ascontiguousarray(seeds, dtype=np.int64), device)
        offs_t = host_to_device(np.ascontiguousarray(offsets, dtype=np.int64), device)
        row_seeds = seeds_t.repeat_interleave(width)
        row_offs = (offs_t.unsqueeze(1) + pos.unsqueeze(0)).reshape(-1)
        noise = exponential_noise(row_seeds, row_offs, vocab)
        # y ~ p at every position: the token of plain sampling at the same index
        sampled = (probs / noise).argmax(dim=-1).view(n, width)
        if draft_probs is None:
            accept = sampled[:, :k] == drafts
            choice = sampled
        else:
            p3 = probs.view(n, width, vocab)[:, :k]
            q = draft_probs.to(device=device, dtype=torch.float32)
            idx = drafts.clamp(0, vocab - 1).unsqueeze(-1)
            p_x = p3.gather(-1, idx).squeeze(-1)
            q_x = q.gather(-1, idx).squeeze(-1)
            u = uniform_noise(row_seeds, row_offs).view(n, width)[:, :k]
            accept = u * q_x < p_x  # u < p/q without dividing by a zero q
            residual = (p3 - q).clamp(min=0.0)
            # p == q leaves no residual, but then the draft is always accepted
            empty = residual.sum(-1, keepdim=True) <= 0
            residual = torch.where(empty, p3, residual)
            recovered = (residual / noise.view(n, width, vocab)[:, :k]).argmax(-1)
            # past the last draft the bonus token is drawn from p itself
            with_bonus = torch.cat([recovered, sampled[:, k:]], dim=1)
            choice = torch.where(pos.unsqueeze(0) < nd.unsqueeze(1), with_bonus, sampled)
        if greedy.any():
            g = host_to_device(greedy, device).unsqueeze(1)
            choice = torch.where(g, argmax, choice)
            accept = torch.where(g, argmax[:, :k] == drafts, accept)

    accepted_prefix = torch.cumprod((accept & in_draft).to(torch.int64), dim=1)
    num_accepted = accepted_prefix.sum(dim=1)
    final = choice.gather(1, num_accepted.unsqueeze(1))  # [n, 1]
    padded = torch.cat([drafts, torch.full_like(drafts[:, :1], -1)], dim=1)
    tokens = torch.where(pos.unsqueeze(0) < num_accepted.unsqueeze(1), padded, -1)
    tokens = tokens.scatter(1, num_accepted.unsqueeze(1), final)
    return RejectionOutput(tokens, num_accepted)
