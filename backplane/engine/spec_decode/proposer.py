"""The interface every speculative proposer implements.

Each step the engine asks one :class:`Proposer` for up to ``k`` draft tokens
per decoding sequence; the worker then runs the target model over the last
committed token plus the drafts (a ``d + 1``-token chunk) and rejection
sampling (:mod:`backplane.engine.sampling.rejection`) keeps the longest
accepted prefix plus one token of the target's own. A proposer never changes
a request: what it is told is read-only, and it is told when requests go away
so it can drop per-request state (a draft model's KV cache, say).

Context by method:

- ``ngram`` reads only :attr:`ProposalRequest.token_ids` (host, numpy).
- ``draft_model`` reads the token ids (and keeps its own KV cache keyed by
  request id, rolled back to :attr:`ProposalRequest.num_verified_tokens`).
- ``mtp`` reads :attr:`ProposalContext.hidden_states`: the target's hidden
  state of the position each request's last token was sampled from, and
  :attr:`ProposalContext.prefill_states`: those of the positions its prefill
  computed, not yet handed over.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["ProposalContext", "ProposalRequest", "Proposer"]


@dataclass(frozen=True)
class ProposalRequest:
    """One decoding sequence a proposer is asked to draft for.

    :param request_id: the request's id (a key for per-request proposer state).
    :param token_ids: prompt + committed output tokens, read-only; the draft
        continues after ``token_ids[-1]``.
    :param max_tokens: the most tokens to propose for it (``k``, or fewer near
        ``max_tokens`` / the model length); 0 means propose nothing.
    :param num_verified_tokens: tokens whose target KV is in the cache; a proposer
        with its own cache rolls it back to this length before drafting.
    """

    request_id: str
    token_ids: np.ndarray
    max_tokens: int
    num_verified_tokens: int


@dataclass(frozen=True)
class ProposalContext:
    """What the target's previous step leaves for proposers that read the model.

    :param hidden_states: ``[len(requests), hidden]`` on the device, row ``i`` the
        target's hidden state at the position request ``i``'s last token was
        sampled from; ``None`` when the method does not need it (``ngram``).
    :param positions: ``[len(requests)]`` int64 positions of those tokens, or ``None``.
    :param prefill_states: per request (row ``i`` for request ``i``), the target's
        hidden states at positions its prefill computed since they were last handed
        over, as ``(positions, hidden)``: ``[n]`` int64 increasing positions (host) and
        ``[n, hidden]`` on the device; ``None`` for a request without any, or for all.
        Each position's next token is in the request's ``token_ids``.
    """

    hidden_states: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    prefill_states: Sequence[tuple[np.ndarray, torch.Tensor] | None] | None = None


@runtime_checkable
class Proposer(Protocol):
    """Drafts tokens for decoding sequences; implemented per method.

    A proposer may also have ``may_draft(token_ids) -> bool``: whether a
    sequence with these tokens would get a draft. With it, the engine keeps
    asynchronous scheduling between drafts and commits a step in flight only
    when a request's committed tokens already say a draft is likely
    (:meth:`~backplane.engine.spec_decode.verify.SpecDecoder.lookup_due`);
    without it, every step of a speculating engine runs synchronously.

    :ivar method: the configuration's method name (``"ngram"``, ``"draft_model"``, ``"mtp"``).
    :ivar num_speculative_tokens: ``k``, the most tokens proposed per sequence.
    """

    method: str
    num_speculative_tokens: int

    def propose(
        self, requests: Sequence[ProposalRequest], context: ProposalContext | None = None
    ) -> list[list[int]]:
        """Draft tokens for each request.

        :param requests: the decoding sequences of the step, in order.
        :param context: the target's hidden states when the method reads them.
        :return: one list per request, in order, of at most ``requests[i].max_tokens``
            token ids within the vocabulary (empty: no draft, a plain decode).
        """
        ...

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget per-request state of finished, aborted or preempted requests.

        :param request_ids: the requests gone.
        """
        ...
