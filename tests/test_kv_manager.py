"""KV-cache manager: prefix reuse, two-phase admission, host tier, slots, invariants.

A fake "model" writes each token's id into its KV slot of a small int32 cache
tensor (``[num_pages, page_size]``) and, before every compute, checks that the
whole cached context of the sequence holds exactly the sequence's tokens. That
makes every reuse, onboarding and page-table mistake visible as wrong content.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backplane.core.errors import OutOfKVMemoryError
from backplane.engine.kv_cache import HostTier, KVCacheManager
from backplane.engine.request import Request


def params(max_tokens: int = 4) -> SimpleNamespace:
    return SimpleNamespace(max_tokens=max_tokens, stop_token_ids=(), ignore_eos=True)


class Sim:
    """A KV manager over a content-checking fake cache."""

    def __init__(self, num_pages: int, page_size: int, host_pages: int = 0, **kw) -> None:
        self.ps = page_size
        self.cache = torch.full((num_pages, page_size), -1, dtype=torch.int32)
        self.host = HostTier([self.cache], host_pages) if host_pages else None
        self.kv = KVCacheManager(num_pages, page_size, host_tier=self.host, debug=True, **kw)

    def check_context(self, req: Request) -> None:
        c = req.num_computed_tokens
        pos = np.arange(c)
        table = req.kv_state.page_table
        got = self.cache[
            torch.from_numpy(table[pos // self.ps]).long(), torch.from_numpy(pos % self.ps)
        ]
        np.testing.assert_array_equal(got.numpy(), req.token_buffer[:c], err_msg=req.request_id)

    def compute(self, req: Request, n: int) -> None:
        """Check the cached context, then write ``n`` more tokens (pages already allocated)."""
        self.check_context(req)
        c = req.num_computed_tokens
        table = req.kv_state.page_table
        assert len(table) * self.ps >= c + n
        pos = np.arange(c, c + n)
        self.cache[
            torch.from_numpy(table[pos // self.ps]).long(), torch.from_numpy(pos % self.ps)
        ] = torch.from_numpy(req.token_buffer[c : c + n].copy())
        req.num_computed_tokens = c + n
        self.kv.on_computed(req)

    def admit(self, reqs: list[Request], chunk: int | None = None) -> list[Request]:
        """Two-phase admission of a batch; returns the admitted requests (FCFS prefix)."""
        claims = []
        for r in reqs:
            cl = self.kv.claim(r)
            n = r.num_tokens - cl.num_cached_tokens
            if chunk is not None:
                n = min(n, chunk)
            if not self.kv.reserve(cl, n):
                self.kv.unclaim(cl)
                break
            claims.append(cl)
        self.kv.allocate_claimed(claims)
        for cl in claims:
            self.compute(cl.request, cl.num_new_tokens)
        return [cl.request for cl in claims]

    def run_alone(self, req: Request) -> None:
        """Admit and fully prefill one request, then free it (its pages stay cached)."""
        assert self.admit([req]) == [req]
        self.kv.free(req)


def req(rid: str, tokens, max_tokens: int = 4) -> Request:
    return Request(rid, np.asarray(tokens, np.int32), params(max_tokens))


def test_prefix_reuse_shares_pages_and_recomputes_last_token():
    s = Sim(16, 4)
    a = req("a", range(8))  # exactly 2 full pages
    assert s.admit([a]) == [a]
    assert a.stats.reused_pages == 0 and a.stats.missed_tokens == 8
    b = req("b", range(8))
    s.admit([b])
    # only 1 page reusable: the last prompt token is always recomputed
    assert b.stats.reused_pages == 1 and b.stats.reused_tokens == 4
    assert b.stats.missed_tokens == 4 and b.kv_state.page_table[0] == a.kv_state.page_table[0]
    c = req("c", list(range(8)) + [99])
    s.admit([c])
    assert c.stats.reused_pages == 2 and c.stats.new_pages == 1
    s.kv.check_invariants([a, b, c])
    assert s.kv.pool.ref_counts[a.kv_state.page_table[0]] == 3
    for r in (a, b, c):
        s.kv.free(r)
    s.kv.check_invariants([])
    assert s.kv.num_used_pages == 0
    st_ = s.kv.stats
    assert st_.estimated_reused_tokens == st_.realised_reused_tokens == 12


def test_released_pages_park_when_cached_and_free_otherwise():
    """Finishing and unclaiming put pages away alike: cached ones idle in the LRU, others free."""
    s = Sim(16, 4)
    a = req("a", range(10))  # 2 full cached pages + 1 partial page
    s.admit([a])
    table = a.kv_state.page_table.tolist()
    assert [s.kv.prefix.hash_of(p) is not None for p in table] == [True, True, False]
    free_before = s.kv.pool.num_free
    s.kv.free(a)
    # the tail page first: a sequence's shared head stays cached longest
    assert s.kv.prefix.idle_pages() == [table[1], table[0]]
    assert s.kv.pool.num_free == free_before + 1 and table[2] in s.kv.pool.free_pages()
    s.kv.check_invariants([])

    b = req("b", range(10))
    claim = s.kv.claim(b)
    assert [d for d, _ in claim.hits] == [table[0], table[1]]
    assert s.kv.prefix.idle_pages() == []
    s.kv.unclaim(claim)
    assert sorted(s.kv.prefix.idle_pages()) == sorted(table[:2])
    s.kv.check_invariants([])


def test_host_pages_report_the_prefix_they_hold():
    s = Sim(4, 2, host_pages=4)
    a = req("a", range(5), max_tokens=1)  # 2 full pages cached
    s.run_alone(a)
    hashes = list(a.kv_state.hashes[:2])
    b = req("b", [9] * 5, max_tokens=1)  # 3 pages of 3: both cached pages go to the host
    s.run_alone(b)
    assert s.kv.stats.offloaded_pages == 2
    for h in hashes:
        hp = s.host.get(h)
        assert hp is not None and s.host.hash_of(hp) == h
    assert s.host.hash_of(s.host.num_pages - 1) is None


def test_generated_tokens_become_reusable_after_compute():
    s = Sim(16, 4)
    a = req("a", range(6), max_tokens=8)
    s.admit([a])
    for t in (50, 51, 52):  # decode: sample, then compute the sampled token
        a.append_token(t)
        assert s.kv.allocate_slots(a, 1)
        s.compute(a, 1)
    assert a.num_computed_tokens == 9
    s.kv.free(a)
    b = req("b", [0, 1, 2, 3, 4, 5, 50, 51, 52, 7])
    s.admit([b])
    assert b.stats.reused_pages == 2


def _fill_host(s: Sim) -> tuple[list[int], list[int]]:
    """Cache x and b prefixes (2 pages each) on the host; the device LRU holds filler."""
    x = list(range(100, 108))
    b = list(range(200, 208))
    s.run_alone(req("x", x + [1]))
    s.run_alone(req("b0", b + [1]))
    # 8 usable pages: a 32-token filler evicts x and b to the host (4 host pages, now full)
    s.run_alone(req("filler", list(range(300, 332)) + [1]))
    assert s.kv.stats.offloaded_pages == 4 and len(s.host) == 4
    return x, b


def test_two_phase_admission_keeps_every_promise():
    s = Sim(10, 4, host_pages=4)
    x, b = _fill_host(s)
    ra = req("a", x + [7, 7])
    rb = req("b", b + [8, 8])
    assert s.admit([ra, rb]) == [ra, rb]
    # onboarding a's pages evicted filler pages whose offload found the host full of
    # claimed pages: nothing promised to b was evicted
    assert ra.stats.onboarded_pages == 2 and rb.stats.onboarded_pages == 2
    st_ = s.kv.stats
    assert st_.estimated_reused_tokens == st_.realised_reused_tokens
    s.kv.check_invariants([ra, rb])


def test_sequential_admission_would_break_the_estimate():
    """Why phase 1 covers the whole batch: claiming b after a's onboarding loses b's pages."""
    s = Sim(10, 4, host_pages=4)
    x, b = _fill_host(s)
    ra = req("a", x + [7, 7])
    rb = req("b", b + [8, 8])
    # what a scheduler would estimate for b before admitting anything
    est = s.kv.claim(rb).num_cached_tokens
    s.kv.unclaim(rb.kv_state.claim)
    assert est == 8
    s.admit([ra])  # a alone: its onboarding evicts filler, offload evicts b's host pages
    s.admit([rb])
    assert rb.stats.cached_tokens < est
    s.kv.check_invariants([ra, rb])


def test_onboarded_by_one_request_is_shared_by_the_next_in_the_batch():
    s = Sim(10, 4, host_pages=4)
    x, _ = _fill_host(s)
    r1 = req("1", x + [5])
    r2 = req("2", x + [6, 6])
    s.admit([r1, r2])
    assert r1.stats.onboarded_pages == 2 and r2.stats.reused_pages == 2
    assert (r1.kv_state.page_table[:2] == r2.kv_state.page_table[:2]).all()
    s.kv.check_invariants([r1, r2])


def test_recurrent_models_get_slots_and_no_prefix_reuse(caplog):
    with caplog.at_level("INFO"):
        s = Sim(16, 4, num_state_slots=3)
    assert not s.kv.prefix_caching and "recurrent" in caplog.text
    a, b, c = req("a", range(9)), req("b", range(9)), req("c", range(9))
    assert s.admit([a, b, c]) == [a, b], "two slots (slot 0 is reserved): c must wait"
    assert {a.kv_state.slot, b.kv_state.slot} == {1, 2}
    assert b.stats.reused_pages == 0
    s.kv.free(a)
    assert s.admit([c]) == [c] and c.kv_state.slot == 1


def test_request_larger_than_pool_is_rejected_clearly():
    s = Sim(5, 4)  # 4 usable pages = 16 tokens
    s.kv.check_fits(req("ok", range(10), max_tokens=6))
    with pytest.raises(OutOfKVMemoryError, match="holds 4 pages"):
        s.kv.check_fits(req("big", range(10), max_tokens=7))


def test_reserve_refuses_without_touching_state():
    s = Sim(5, 4)
    a = req("a", range(12))
    s.admit([a])
    b = req("b", range(20, 32))
    cl = s.kv.claim(b)
    assert not s.kv.reserve(cl, 12)
    s.kv.unclaim(cl)
    s.kv.check_invariants([a])
    assert s.kv.num_available_pages == 1


# -- property-based: random admissions, chunks, decodes, preemptions, aborts -----------------


class KVMachine(RuleBasedStateMachine):
    """Random traffic over a tiny pool with shared prefixes, with and without a host tier."""

    def __init__(self) -> None:
        super().__init__()
        self.sim: Sim | None = None
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.history: list[list[int]] = []
        self.n = 0

    @precondition(lambda self: self.sim is None)
    @rule(host_pages=st.sampled_from([0, 3, 8]), num_pages=st.integers(6, 14))
    def setup(self, host_pages: int, num_pages: int) -> None:
        self.sim = Sim(num_pages, 4, host_pages=host_pages)

    @precondition(lambda self: self.sim is not None and len(self.waiting) < 6)
    @rule(
        prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 1]]),
        tail=st.lists(st.integers(0, 3), min_size=0, max_size=9),
        max_tokens=st.integers(1, 6),
    )
    def add(self, prefix: list[int], tail: list[int], max_tokens: int) -> None:
        toks = prefix + tail or [0]
        if -(-(len(toks) + max_tokens) // 4) > self.sim.kv.pool.num_usable:
            return
        self.n += 1
        self.waiting.append(req(f"r{self.n}", toks, max_tokens))
        self.history.append(toks)

    @precondition(lambda self: self.sim is not None and self.history and len(self.waiting) < 6)
    @rule(i=st.integers(0, 100), extra=st.integers(0, 3))
    def repeat(self, i: int, extra: int) -> None:
        """Re-send an earlier prompt (plus a token or so): hits on device or host pages."""
        toks = self.history[i % len(self.history)] + [extra] * (extra % 2)
        if -(-(len(toks) + 1) // 4) > self.sim.kv.pool.num_usable:
            return
        self.n += 1
        self.waiting.append(req(f"r{self.n}", toks, 1))

    @precondition(lambda self: self.sim is not None)
    @rule(pages=st.integers(1, 8))
    def flush(self, pages: int) -> None:
        """Run a request of unique tokens through whatever is free: evicts idle cached pages."""
        pages = min(pages, self.sim.kv.num_available_pages)
        if pages < 1:
            return
        self.n += 1
        r = req(f"f{self.n}", [100 + self.n] * (4 * pages), 1)
        if self.sim.admit([r]) == [r]:
            self.sim.kv.free(r)

    @precondition(lambda self: self.sim is not None and self.waiting)
    @rule(k=st.integers(1, 4), chunk=st.sampled_from([None, 1, 3, 8]))
    def admit(self, k: int, chunk: int | None) -> None:
        got = self.sim.admit(self.waiting[:k], chunk)
        for r in got:
            self.waiting.remove(r)
            self.running.append(r)

    @precondition(lambda self: self.sim is not None and self.running)
    @rule(i=st.integers(0, 100), n=st.integers(1, 6), token=st.integers(0, 3))
    def advance(self, i: int, n: int, token: int) -> None:
        r = self.running[i % len(self.running)]
        kv = self.sim.kv
        if r.num_uncomputed_tokens == 0:  # a step ended: sample
            if r.append_token(token) is not None:
                self.running.remove(r)
                kv.free(r)
                return
        n = min(n, r.num_uncomputed_tokens)
        if not kv.allocate_slots(r, n):  # preempt by recompute
            self.running.remove(r)
            kv.free(r)
            assert r.kv_state.num_pages == 0 and r.num_computed_tokens == 0
            self.waiting.insert(0, r)
            return
        self.sim.compute(r, n)

    @precondition(lambda self: self.sim is not None and (self.running or self.waiting))
    @rule(i=st.integers(0, 100))
    def abort(self, i: int) -> None:
        pool = self.running + self.waiting
        r = pool[i % len(pool)]
        (self.running if r in self.running else self.waiting).remove(r)
        self.sim.kv.free(r)

    @invariant()
    def consistent(self) -> None:
        if self.sim is None:
            return
        kv = self.sim.kv
        kv.check_invariants(self.running)
        assert kv.stats.estimated_reused_tokens == kv.stats.realised_reused_tokens
        for r in self.running:
            self.sim.check_context(r)

    def teardown(self) -> None:
        if self.sim is None:
            return
        for r in self.running:
            self.sim.kv.free(r)
        kv = self.sim.kv
        kv.check_invariants([])
        assert kv.num_used_pages == 0, "pages leaked after every request finished"
        assert (kv.pool.ref_counts == 0).all()
        assert kv.pool.num_free + kv.prefix.num_evictable == kv.pool.num_usable
        if self.sim.host is not None:
            assert self.sim.host.num_claimed() == 0


KVMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVMachine = KVMachine.TestCase


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_page_counts_are_ceilings(page_size: int) -> None:
    """The manager's page count and a sequence's page-table width both round up."""
    import math

    from backplane.engine.sizes import pages_per_seq

    kv = KVCacheManager(64, page_size)
    for tokens in range(0, 4 * page_size + 2):
        want = math.ceil(tokens / page_size)
        assert kv.pages_for(tokens) == want
        assert pages_per_seq(tokens, page_size) == want
