"""N-gram proposer: prompt lookup over the request's own tokens, on the host.

The last ``n`` tokens of a sequence (``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``) are searched for earlier in its prompt + output; at the
most recent earlier match, the tokens that followed it are the draft. Text
that repeats its context (rewriting a given document, code edits, quoting)
is drafted correctly most of the time, at no device cost.

When the match is so recent that fewer than ``k`` tokens follow it, the text
is taken to repeat with the match's distance as its period: the tokens after
the match's continuation are that continuation again, so a sequence cycling
with a short period is drafted ``k`` tokens deep rather than only to its end.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import numpy as np

from backplane.core.errors import ConfigError
from backplane.engine.spec_decode.config import SpeculativeConfig
from backplane.engine.spec_decode.proposer import ProposalContext, ProposalRequest

__all__ = ["NgramProposer", "find_draft"]

logger = logging.getLogger(__name__)


def find_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The ``k`` tokens predicted to follow the sequence, by prompt lookup.

    Longer suffixes are tried first (a longer match predicts better); for one
    length the most recent earlier match wins (it is the likeliest to continue
    alike, and in a periodic text it sits one period back). The draft is what
    followed that match; when fewer than ``k`` tokens follow it, the distance
    from the match to the suffix is taken as the text's period and the
    continuation repeats to fill ``k``.

    :param tokens: ``[L]`` integer token ids, the sequence so far.
    :param min_n: shortest suffix matched (``>= 1``).
    :param max_n: longest suffix matched.
    :param k: most tokens returned.
    :return: the draft, ``[k]`` int64, or empty when nothing matches or ``k <= 0``.
    """
    length = len(tokens)
    if k <= 0 or length < 2:
        return np.empty(0, dtype=np.int64)
    tokens = np.asarray(tokens)
    # A match of any length ends at an earlier occurrence of the last token: one pass
    # finds those, and each longer suffix only filters them (no window per position).
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        hits = ends[ends >= n - 1]
        for back in range(1, n):
            if not len(hits):
                break
            hits = hits[tokens[hits - back] == tokens[length - 1 - back]]
        if len(hits):
            start = int(hits[-1]) + 1
            # the suffix equals the match, so token length + i equals token start + i:
            # past the sequence's end that is the draft's own token i - period
            period = length - start
            return tokens[start + np.arange(k) % period].astype(np.int64)
    return np.empty(0, dtype=np.int64)


class NgramProposer:
    """Proposes drafts by prompt lookup (see :func:`find_draft`); keeps no state.

    :param config: a ``method="ngram"`` :class:`SpeculativeConfig`.
    :raises ConfigError: for another method.
    """

    method = "ngram"

    def __init__(self, config: SpeculativeConfig) -> None:
        if config.method != "ngram":
            raise ConfigError(f"NgramProposer takes method='ngram', got {config.method!r}")
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(
        self, requests: Sequence[ProposalRequest], context: ProposalContext | None = None
    ) -> list[list[int]]:
        """Draft up to ``min(k, request.max_tokens)`` tokens per request.

        :param requests: the decoding sequences.
        :param context: unused (prompt lookup reads only the token ids).
        :return: one draft per request.
        """
        k = self.num_speculative_tokens
        return [
            find_draft(r.token_ids, self.min_n, self.max_n, min(k, r.max_tokens)).tolist()
            for r in requests
        ]

    def may_draft(self, token_ids: np.ndarray) -> bool:
        """Whether the sequence's own suffix occurs earlier in it (a lookup would draft).

        :param token_ids: ``[L]`` the sequence so far.
        :return: ``True`` when :func:`find_draft` finds a match.
        """
        return len(find_draft(token_ids, self.min_n, self.max_n, 1)) > 0

    def release(self, request_ids: Iterable[str]) -> None:
        """Nothing to forget: prompt lookup keeps no per-request state.

        :param request_ids: the requests gone.
        """
