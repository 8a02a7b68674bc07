"""Prompt lookup (the ``ngram`` proposer) against references written apart from it.

A brute-force reference scans every earlier position as a list, longest suffix
first, most recent match first, and extends the text by copying what followed
the match one token at a time (so a match closer than ``k`` tokens repeats its
own continuation). Periodic sequences are checked against their true
continuation, which needs no reference at all.
"""

from __future__ import annotations

import numpy as np
import pytest

from backplane.engine.spec_decode.config import SpeculativeConfig
from backplane.engine.spec_decode.ngram import NgramProposer, find_draft
from backplane.engine.spec_decode.proposer import ProposalRequest


def _brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Every candidate ``(n, start)`` in order of preference; the first match drafts."""
    if k <= 0:
        return []
    candidates = [
        (n, start)
        for n in range(max_n, min_n - 1, -1)
        if n < len(tokens)
        for start in reversed(range(len(tokens) - n))
    ]
    for n, start in candidates:
        if tokens[start : start + n] == tokens[len(tokens) - n :]:
            text = list(tokens)
            while len(text) < len(tokens) + k:
                text.append(text[start + n + len(text) - len(tokens)])
            return text[len(tokens) :]
    return []


@pytest.mark.parametrize("seed", range(40))
def test_find_draft_equals_brute_force_on_random_sequences(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(50):
        vocab = int(rng.integers(2, 6))
        tokens = rng.integers(0, vocab, size=int(rng.integers(0, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(0, 9))
        got = find_draft(np.array(tokens, dtype=np.int32), min_n, max_n, k)
        assert got.dtype == np.int64
        assert got.tolist() == _brute_force(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


@pytest.mark.parametrize("period", [1, 2, 3, 5])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_periodic_text_is_drafted_k_deep_as_it_continues(period: int, k: int) -> None:
    rng = np.random.default_rng([period, k])
    # distinct tokens in one period: its only earlier matches sit whole periods back
    base = rng.permutation(100)[:period]
    text = np.tile(base, 20)
    for length in range(period + 1, 3 * period + 4):
        for min_n, max_n in ((1, 1), (1, 4), (2, 3)):
            if length - period < min_n:
                continue
            got = find_draft(text[:length], min_n, max_n, k).tolist()
            assert got == text[length : length + k].tolist(), (length, min_n, max_n)


def test_a_suffix_seen_once_drafts_what_followed_it_then_repeats() -> None:
    # "7 8" last came three tokens back: the draft is "9 7 8", then the same again
    tokens = np.array([1, 2, 7, 8, 9, 7, 8], dtype=np.int32)
    assert find_draft(tokens, 1, 3, 8).tolist() == [9, 7, 8, 9, 7, 8, 9, 7]
    # a match with k tokens after it is read as it stands
    tokens = np.array([3, 4, 5, 6, 1, 2, 9, 9, 9, 3, 4], dtype=np.int32)
    assert find_draft(tokens, 1, 3, 4).tolist() == [5, 6, 1, 2]


def test_longer_match_wins_over_a_more_recent_shorter_one() -> None:
    # "1 2 3" occurs at 0; "3" alone occurs more recently at 6
    tokens = np.array([1, 2, 3, 4, 5, 0, 3, 6, 1, 2, 3], dtype=np.int32)
    assert find_draft(tokens, 1, 3, 2).tolist() == [4, 5]
    assert find_draft(tokens, 1, 1, 2).tolist() == [6, 1]


@pytest.mark.parametrize(
    ("tokens", "min_n", "max_n", "k", "want"),
    [
        ([], 1, 4, 4, []),
        ([5], 1, 4, 4, []),
        ([5, 5], 1, 4, 3, [5, 5, 5]),
        ([5, 6], 1, 4, 3, []),
        ([5, 5], 2, 4, 3, []),  # a 2-gram has no earlier position in two tokens
        ([4, 5, 4], 1, 4, 5, [5, 4, 5, 4, 5]),
        ([4, 5, 4], 1, 4, 0, []),
    ],
)
def test_short_contexts(tokens: list[int], min_n: int, max_n: int, k: int, want: list[int]) -> None:
    assert find_draft(np.array(tokens, dtype=np.int32), min_n, max_n, k).tolist() == want
    assert _brute_force(tokens, min_n, max_n, k) == want


def test_proposer_drafts_a_cycle_k_deep_within_each_request_limit() -> None:
    prop = NgramProposer(SpeculativeConfig("ngram", 4, 1, 3))
    cycle = np.array([10, 11, 10, 11, 10], dtype=np.int32)
    reqs = [ProposalRequest("a", cycle, 8, 8), ProposalRequest("b", cycle, 3, 8)]
    assert prop.propose(reqs) == [[11, 10, 11, 10], [11, 10, 11]]
