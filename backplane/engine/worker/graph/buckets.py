"""Padded sizes ("buckets") at which graphs are captured, and the choice of one per step."""

from __future__ import annotations

import bisect
from collections.abc import Iterable


def powers_of_two_up_to(limit: int) -> list[int]:
    """Return ``1, 2, 4, ...`` up to ``limit``, plus ``limit`` itself when it is not a power of two.

    :param limit: the largest size that must have a bucket.
    :return: the sorted, de-duplicated sizes.
    """
    if limit < 1:
        raise ValueError(f"bucket limit must be >= 1, got {limit}")
    sizes = []
    n = 1
    while n < limit:
        sizes.append(n)
        n *= 2
    sizes.append(limit)
    return sorted(set(sizes))


def token_buckets(max_num_tokens: int, sizes: Iterable[int] | None = None) -> list[int]:
    """Buckets of the piecewise runner (flat token counts).

    Pure-prefill batches can fill the whole token budget, so ``max_num_tokens``
    always has a bucket, whatever the configured sizes.

    One token gets no bucket of its own when larger ones exist: a decode of one
    sequence runs its decode graph, and a one-token prompt chunk pads to the next
    bucket for the price of one padding token, not a capture at start-up.

    :param max_num_tokens: the scheduler's token budget per step.
    :param sizes: configured sizes (default: powers of two).
    :return: sorted sizes, none above ``max_num_tokens``.
    """
    chosen = _buckets_up_to(max_num_tokens, sizes)
    return chosen[1:] if len(chosen) > 1 and chosen[0] == 1 else chosen


#: the largest decode graph captured by default: a decode step of more sequences
#: runs its piecewise graph instead. Such a step takes tens of milliseconds on the
#: device, so the host's launches hide behind it, while each bucket above 512 would
#: cost seconds of start-up and gigabytes of graph memory (vLLM caps its captures
#: at the same size)
MAX_DECODE_GRAPH_SEQS = 512


def decode_buckets(max_num_seqs: int, sizes: Iterable[int] | None = None) -> list[int]:
    """Buckets of the monolithic decode graphs (batch sizes).

    :param max_num_seqs: the most sequences in one step.
    :param sizes: configured sizes (default: powers of two up to ``max_num_seqs`` or
        :data:`MAX_DECODE_GRAPH_SEQS`, whichever is smaller).
    :return: sorted sizes, none above ``max_num_seqs``.
    """
    if sizes is None:
        return _buckets_up_to(min(max_num_seqs, MAX_DECODE_GRAPH_SEQS), None)
    return _buckets_up_to(max_num_seqs, sizes)


#: verify graphs hold at most this many rows beyond ``max_num_seqs`` (larger
#: speculative steps, rare under the loads where speculation pays, run piecewise)
VERIFY_ROWS = 256


def verify_rows(max_num_seqs: int, max_num_tokens: int, verify_len: int) -> int:
    """The most rows (chunk positions) a verify graph runs; 0 when none is captured.

    :param max_num_seqs: the most sequences in one step.
    :param max_num_tokens: the scheduler's token budget per step.
    :param verify_len: the longest verifying chunk (``num_speculative_tokens + 1``),
        0 without speculation.
    :return: the largest verify bucket.
    """
    if verify_len < 2:
        return 0
    return min(max_num_tokens, max_num_seqs * verify_len, max(max_num_seqs, VERIFY_ROWS))


def _buckets_up_to(limit: int, sizes: Iterable[int] | None) -> list[int]:
    # the limit itself always gets a bucket: a full step must never fall back to eager
    chosen = powers_of_two_up_to(limit) if sizes is None else list(sizes)
    chosen = [s for s in chosen if 1 <= s <= limit]
    chosen.append(limit)
    return sorted(set(chosen))


def pick_bucket(n: int, buckets: list[int]) -> int | None:
    """Return the smallest bucket ``>= n``, or ``None`` when ``n`` exceeds them all.

    :param n: the real size of the step.
    :param buckets: sorted sizes.
    """
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None
