"""Prefix reuse with recurrent-state snapshots, at the KV-cache manager.

A fake recurrent "state" makes every copy visible: each state slot holds the
list of tokens its sequence has consumed. Computing a chunk checks that the
request's slot holds exactly the tokens before it (the state a real recurrent
layer would need there), then appends the chunk; the manager's queued copies
(saves, then restores) are applied between steps as the engine issues them.
So a restore from the wrong snapshot, a save of the wrong position or a
snapshot slot handed to a live request while still in use shows up as wrong
content, independently of the manager's own bookkeeping.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from backplane.core.metadata import NULL_SLOT
from backplane.engine.kv_cache import KVCacheManager
from backplane.engine.request import Request

PAGE = 4


def params(max_tokens: int = 4) -> SimpleNamespace:
    return SimpleNamespace(max_tokens=max_tokens, stop_token_ids=(), ignore_eos=True)


def req(rid: str, tokens, max_tokens: int = 4) -> Request:
    return Request(rid, np.asarray(tokens, np.int32), params(max_tokens))


class StateSim:
    """A manager with snapshots over a fake per-slot state (tokens consumed)."""

    def __init__(self, num_pages: int, num_state_slots: int) -> None:
        self.kv = KVCacheManager(
            num_pages, PAGE, num_state_slots=num_state_slots, state_snapshots=True, debug=True
        )
        self.state: list[list[int]] = [[] for _ in range(num_state_slots)]

    def flush(self) -> None:
        """Apply the queued copies as the worker does: every save, then every restore."""
        saves, restores = self.kv.take_state_copies()
        for pairs in (saves, restores):
            src = [list(self.state[s]) for s, _ in pairs]
            for (_, d), v in zip(pairs, src, strict=True):
                self.state[d] = v

    def compute(self, r: Request, n: int) -> None:
        """Check the request's state, consume ``n`` tokens, keep a snapshot where due."""
        self.flush()
        c = r.num_computed_tokens
        slot = r.kv_state.slot
        if c == 0:
            self.state[slot] = []  # no initial state: the kernels start from zeros
        assert self.state[slot] == r.token_buffer[:c].tolist(), r.request_id
        self.state[slot] = self.state[slot] + r.token_buffer[c : c + n].tolist()
        r.num_computed_tokens = c + n
        self.kv.on_computed(r)
        if r.num_computed_tokens == self.kv.snapshot_position(r):
            self.kv.save_state(r)

    def admit(self, r: Request, chunk: int = 64) -> bool:
        """Admit ``r`` alone with the scheduler's chunk rule; False if it does not fit."""
        cl = self.kv.claim(r)
        n = min(r.num_tokens - cl.num_cached_tokens, chunk)
        n = self.kv.snapshot_cut(r, n, cl.num_cached_tokens)
        if not self.kv.reserve(cl, n):
            self.kv.unclaim(cl)
            return False
        self.kv.allocate_claimed([cl])
        self.compute(r, n)
        return True

    def prefill(self, r: Request, chunk: int = 64) -> None:
        """Admit and compute the whole prompt in chunks."""
        assert self.admit(r, chunk)
        while r.num_computed_tokens < r.num_tokens:
            n = self.kv.snapshot_cut(r, min(r.num_tokens - r.num_computed_tokens, chunk))
            assert self.kv.allocate_slots(r, n)
            self.compute(r, n)

    def check(self, live: list[Request]) -> None:
        self.kv.check_invariants(live)


def test_hit_is_cut_to_the_last_page_with_a_snapshot():
    s = StateSim(64, 6)
    a = req("a", range(18))
    s.prefill(a)  # the chunk stops at 16 (the prompt's last full page), then goes on
    assert s.kv.snapshots.saved == 1
    s.kv.free(a)
    b = req("b", list(range(18)) + [50, 51, 52, 53, 54])
    cl = s.kv.claim(b)
    assert cl.num_cached_tokens == 16 and cl.state_snapshot != NULL_SLOT
    s.kv.unclaim(cl)
    s.prefill(b)  # the fake state checks the restored snapshot holds tokens 0..15
    assert b.stats.reused_tokens == 16
    assert s.kv.snapshots.restored == 1
    s.check([b])
    s.kv.free(b)
    s.check([])


def test_no_snapshot_no_reuse():
    s = StateSim(64, 6)
    # 16 tokens: the state is kept at 16 only; a prompt sharing 9 tokens hits 2 pages
    a = req("a", range(16))
    s.prefill(a)
    s.kv.free(a)
    b = req("b", list(range(9)) + [70, 71, 72])
    cl = s.kv.claim(b)
    # pages 0 and 1 are cached, but no state was kept at 4 or 8
    assert s.kv.prefix.get(s_hash(s, b, 1)) is not None
    assert cl.num_cached_tokens == 0 and cl.state_snapshot == NULL_SLOT
    s.kv.unclaim(cl)
    s.check([])


def s_hash(s: StateSim, r: Request, page: int) -> int:
    from backplane.engine.kv_cache import hash_pages

    h: list[int] = []
    hash_pages(r.token_buffer, PAGE, h, page + 1)
    return h[page]


def test_live_requests_evict_idle_snapshots_but_not_pinned_ones():
    # two usable slots: one live request and one snapshot fill them
    s = StateSim(64, 3)
    a = req("a", range(10))
    s.prefill(a)
    s.kv.free(a)
    assert len(s.kv.snapshots) == 1 and s.kv.slots.num_free == 1
    b = req("b", range(100, 110))
    s.prefill(b)  # takes the free slot; its own snapshot evicts a's (LRU) to have one
    assert s.kv.snapshots.evicted == 1 and len(s.kv.snapshots) == 1
    s.check([b])
    c = req("c", range(200, 206))
    assert s.admit(c)  # no free slot: b's idle snapshot gives way to the live request
    assert s.kv.snapshots.evicted == 2 and len(s.kv.snapshots) == 0
    s.check([b, c])
    for r in (b, c):
        s.kv.free(r)
    s.check([])
    f = req("f", range(200, 206))
    s.prefill(f)  # keeps its state at 4
    s.kv.free(f)
    assert len(s.kv.snapshots) == 1
    d = req("d", list(range(200, 206)) + [7, 7, 7])
    cl = s.kv.claim(d)
    assert cl.num_cached_tokens == 4 and cl.state_snapshot != NULL_SLOT
    assert s.kv.num_available_slots == 1  # the pinned snapshot is not counted
    assert s.kv.reserve(cl, 4)
    s.kv.allocate_claimed([cl])
    s.check([d])
    assert s.kv.slots.num_free == 0 and s.kv.snapshots.num_evictable == 1
    e = req("e", range(300, 305))
    cl = s.kv.claim(e)
    assert s.kv.reserve(cl, 5)  # the snapshot is idle again: evictable for a live request
    s.kv.allocate_claimed([cl])
    assert len(s.kv.snapshots) == 0
    s.compute(d, 4)  # d's restore was queued before the eviction: it reads f's state
    s.check([d, e])
    for r in (d, e):
        s.kv.free(r)
    s.check([])
    assert s.kv.slots.num_free + len(s.kv.snapshots) == 2


def test_pinned_snapshot_blocks_reserve_until_unclaimed():
    s = StateSim(64, 3)
    a = req("a", range(9))
    s.prefill(a)  # a keeps slot 1 live; its snapshot at 8 takes slot 2
    assert len(s.kv.snapshots) == 1 and s.kv.slots.num_free == 0
    b = req("b", list(range(9)) + [1])
    cl = s.kv.claim(b)
    assert cl.state_snapshot != NULL_SLOT
    assert not s.kv.reserve(cl, 2)  # the only other slot is the pinned snapshot
    s.kv.unclaim(cl)
    assert s.kv.snapshots.num_evictable == 1
    s.check([a])
    s.kv.free(a)
    s.check([])


def test_snapshot_of_a_request_freed_before_the_copy_still_saves_its_state():
    s = StateSim(64, 6)
    a = req("a", range(12))
    s.prefill(a)  # the save of a's slot is queued, not yet issued
    s.kv.free(a)
    b = req("b", range(500, 507))  # takes a's freed slot in the same schedule
    cl = s.kv.claim(b)
    assert s.kv.reserve(cl, 7)
    s.kv.allocate_claimed([cl])
    s.compute(b, 7)  # flushes the save (reads a's state) before b's compute overwrites it
    c = req("c", list(range(12)) + [9, 9])
    s.prefill(c)
    assert c.stats.reused_tokens == 12
    for r in (b, c):
        s.kv.free(r)
    s.check([])
