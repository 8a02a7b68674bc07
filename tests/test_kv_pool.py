"""Page pool, state slots, chained hashes and the prefix cache's LRU."""

from __future__ import annotations

import numpy as np
import pytest

from backplane.engine.kv_cache import BlockPool, PrefixCache, StateSlotPool, hash_pages


def test_pool_never_hands_out_scratch_page_and_recycles():
    pool = BlockPool(6)
    assert pool.num_usable == 5 and pool.num_free == 5
    a = pool.allocate(3)
    b = pool.allocate_one()
    got = sorted(a.tolist() + [b])
    assert 0 not in got and len(set(got)) == 4
    assert (pool.ref_counts[a] == 1).all() and pool.ref_counts[b] == 1
    with pytest.raises(MemoryError):
        pool.allocate(2)
    pool.ref_counts[a] = 0
    pool.push_free(a)
    assert pool.num_free == 4
    c = pool.allocate(4)
    assert sorted(c.tolist()) == sorted(set(range(1, 6)) - {b})
    with pytest.raises(MemoryError):
        pool.allocate_one()
    with pytest.raises(ValueError):
        BlockPool(1)


def test_state_slots_skip_slot_zero():
    slots = StateSlotPool(4)
    got = [slots.allocate() for _ in range(3)]
    assert sorted(got) == [1, 2, 3]
    with pytest.raises(MemoryError):
        slots.allocate()
    slots.free(got[1])
    assert slots.allocate() == got[1]
    assert StateSlotPool(0).num_free == 0


def test_chained_hashes_cover_the_whole_prefix():
    ps = 4
    a = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9], np.int32)
    b = np.array([9, 2, 3, 4, 5, 6, 7, 8, 9], np.int32)  # differs only in page 0
    ha: list[int] = []
    hb: list[int] = []
    hash_pages(a, ps, ha, 2)
    hash_pages(b, ps, hb, 2)
    assert len(ha) == 2 and ha[0] != hb[0]
    assert ha[1] != hb[1], "page 1 is equal but its prefix is not: hashes must differ"
    # incremental extension equals hashing at once
    hc: list[int] = []
    hash_pages(a, ps, hc, 1)
    hash_pages(a, ps, hc, 2)
    assert hc == ha
    hash_pages(a, ps, hc, 1)  # never shrinks or recomputes
    assert hc == ha


def test_prefix_cache_lru_order_and_eviction():
    pc = PrefixCache(8)
    for p, h in [(1, 11), (2, 12), (3, 13)]:
        assert pc.register(p, h)
    assert not pc.register(4, 11), "a prefix already cached keeps its first page"
    assert not pc.register(1, 99), "a cached page cannot take a second hash"
    for p in (2, 1, 3):
        pc.park(p)
    pc.take(1)  # a hit: page 1 leaves the LRU
    assert pc.num_evictable == 2
    assert pc.evict() == (2, 12)
    assert pc.get(12) is None and not pc.is_cached(2)
    pc.park(1)
    assert pc.evict() == (3, 13)
    assert pc.evict() == (1, 11)
    assert len(pc) == 0
