"""Bucket choice for piecewise and decode graphs."""

from __future__ import annotations

import pytest

from backplane.engine.worker.graph.buckets import (
    decode_buckets,
    pick_bucket,
    powers_of_two_up_to,
    token_buckets,
)


def test_powers_of_two_include_the_limit():
    assert powers_of_two_up_to(1) == [1]
    assert powers_of_two_up_to(8) == [1, 2, 4, 8]
    assert powers_of_two_up_to(12) == [1, 2, 4, 8, 12]


def test_token_buckets_always_cover_max_num_tokens():
    # pure-prefill batches can use the whole budget, even with configured sizes
    assert token_buckets(100, sizes=[16, 32, 64]) == [16, 32, 64, 100]
    assert token_buckets(2048)[-1] == 2048
    assert token_buckets(64, sizes=[16, 128]) == [16, 64]


def test_decode_buckets_capped_by_max_num_seqs():
    assert decode_buckets(5) == [1, 2, 4, 5]
    assert decode_buckets(8, sizes=[1, 3, 16]) == [1, 3, 8]


def test_decode_graphs_stop_at_512_sequences_unless_sizes_are_given():
    # a larger decode step runs its piecewise graph: no start-up or memory for buckets above
    assert decode_buckets(1024) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert decode_buckets(600)[-1] == 512
    assert decode_buckets(1024, sizes=[8, 768]) == [8, 768, 1024]


@pytest.mark.parametrize("n", range(1, 40))
def test_pick_bucket_is_smallest_covering(n):
    buckets = [1, 2, 4, 8, 16, 24, 32]
    got = pick_bucket(n, buckets)
    expected = min((b for b in buckets if b >= n), default=None)
    assert got == expected


def test_invalid_limit():
    with pytest.raises(ValueError):
        powers_of_two_up_to(0)
