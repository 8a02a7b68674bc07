"""The KV-cache manager: pages, prefix reuse, host tier, state slots, admission.

Two-phase batch admission
-------------------------
Admitting a batch of waiting requests is split so that the number of reused
tokens the scheduler counts on is exactly the number it gets:

1. :meth:`KVCacheManager.claim` (per request, while the scheduler builds the
   batch): walk the request's chained page hashes and *claim* every matching
   page, on the device (reference count + 1, so it leaves the LRU and cannot be
   evicted) or in the host tier (host claim, so it cannot be evicted from the
   host). The claim says how many tokens are cached; the scheduler sizes the
   request's chunk with it and :meth:`KVCacheManager.reserve` sets aside the
   device pages the request still needs.
2. :meth:`KVCacheManager.allocate_claimed` (once, for the whole batch): onboard
   the claimed host pages and allocate the new pages. Allocation may evict idle
   cached pages (offloading them to the host, which may evict host pages), but
   every page promised to any request of the batch is claimed by then, so
   nothing promised can disappear. Reused tokens realised == estimated; both are
   counted in :class:`KVCacheStats` and compared by an assertion in debug mode.

Models with recurrent layers (SSM, conv, delta) reuse a prefix only up to a
page whose recurrent state was kept: their state after a prefix is one
per-sequence slot, not a page that could be shared, so the manager keeps
copies of it in spare slots (:mod:`backplane.engine.kv_cache.state_cache`)
when a request finishes computing its prompt's last full page
(:meth:`KVCacheManager.snapshot_cut` makes a prefill chunk end there). A hit
is cut back to the longest run of cached pages that ends at such a snapshot,
which the request copies into its own slot; without one nothing is reused.
Without ``state_snapshots`` prefix reuse stays off for these models.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from backplane.core.errors import OutOfKVMemoryError
from backplane.core.launch import cdiv
from backplane.core.metadata import NULL_PAGE, NULL_SLOT
from backplane.engine.kv_cache.block_pool import BlockPool
from backplane.engine.kv_cache.host_tier import HostTier
from backplane.engine.kv_cache.prefix_cache import PrefixCache, hash_pages
from backplane.engine.kv_cache.state_cache import StateCopies, StateSnapshots
from backplane.engine.kv_cache.state_slots import StateSlotPool
from backplane.engine.request import Request

__all__ = ["Claim", "KVCacheManager", "KVCacheStats", "RequestKV"]

logger = logging.getLogger(__name__)

_EMPTY = np.zeros(0, dtype=np.int32)


@dataclass
class KVCacheStats:
    """Counters of the KV-cache manager (monotonic unless noted).

    :param admissions: requests admitted (a resumed preempted request counts again).
    :param lookup_pages: full pages looked up in the prefix cache at admission.
    :param device_hit_pages: of those, found on the device.
    :param host_hit_pages: of those, found in the host tier.
    :param estimated_reused_tokens: cached tokens promised by phase-1 claims of admitted requests.
    :param realised_reused_tokens: cached tokens actually delivered in phase 2 (equal, always).
    :param new_pages: pages newly allocated to requests.
    :param evicted_pages: idle cached pages evicted from the device.
    :param offloaded_pages: evicted pages copied to the host tier.
    :param onboarded_pages: host pages copied back to the device.
    """

    admissions: int = 0
    lookup_pages: int = 0
    device_hit_pages: int = 0
    host_hit_pages: int = 0
    estimated_reused_tokens: int = 0
    realised_reused_tokens: int = 0
    new_pages: int = 0
    evicted_pages: int = 0
    offloaded_pages: int = 0
    onboarded_pages: int = 0


class RequestKV:
    """What the manager keeps per request (``request.kv_state``).

    :param capacity_pages: pages the request can ever need.
    """

    __slots__ = ("pages", "num_pages", "table", "hashes", "num_registered", "slot", "claim")

    def __init__(self, capacity_pages: int) -> None:
        self.pages = np.zeros(capacity_pages, dtype=np.int32)  # page table, first num_pages valid
        self.num_pages = 0
        self.table = self.pages[:0]  # view of the valid part, rebuilt only when it grows
        self.hashes: list[int] = []  # chained hashes of leading full pages (kept across preemption)
        self.num_registered = 0  # leading pages already offered to the prefix cache
        self.slot = NULL_SLOT
        self.claim: Claim | None = None

    @property
    def page_table(self) -> np.ndarray:
        """The request's pages (a view, no copy)."""
        return self.table

    def set_num_pages(self, n: int) -> None:
        """Record that the first ``n`` entries of :attr:`pages` are valid."""
        self.num_pages = n
        self.table = self.pages[:n]


@dataclass
class Claim:
    """Phase-1 result for one request: the pages it was promised.

    :param request: the request.
    :param hits: per leading page, ``(device_page, -1)`` for a device hit or
        ``(-1, host_page)`` for a host hit, in page order.
    :param num_lookup: pages looked up (the hit chain stops at the first miss).
    :param page_size: tokens per page.
    :param state_snapshot: the pinned recurrent-state snapshot slot the request
        starts from, at the end of its last hit (``NULL_SLOT`` for none).
    """

    request: Request
    hits: list[tuple[int, int]]
    num_lookup: int
    page_size: int
    state_snapshot: int = NULL_SLOT
    num_new_tokens: int = 0
    reserved_pages: int = 0
    reserved_slot: bool = False
    num_host_hits: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_host_hits = sum(1 for d, _ in self.hits if d < 0)

    @property
    def num_cached_tokens(self) -> int:
        """Tokens the request will not compute (the scheduler's estimate of reuse)."""
        return len(self.hits) * self.page_size

    @property
    def num_device_hits(self) -> int:
        """Claimed pages already on the device."""
        return len(self.hits) - self.num_host_hits


class KVCacheManager:
    """Owns the page pool, the prefix cache, the host tier and the state slots.

    :param num_pages: pages in the pool, including the reserved scratch page 0.
    :param page_size: tokens per page.
    :param num_state_slots: recurrent-state slots including the reserved slot 0
        (0 when the model has no recurrent layers); each live request gets one.
    :param enable_prefix_caching: reuse computed full pages across requests
        (forced off when ``num_state_slots > 0`` without ``state_snapshots``).
    :param state_snapshots: with recurrent layers, keep recurrent-state snapshots at
        page boundaries in spare slots so that prefix reuse works for them too; the
        slot pool should hold spare slots beyond one per live sequence.
    :param host_tier: optional :class:`HostTier` keeping evicted reusable pages.
    :param debug: check internal invariants (estimate == realised) with assertions.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        num_state_slots: int = 0,
        enable_prefix_caching: bool = True,
        state_snapshots: bool = False,
        host_tier: HostTier | None = None,
        debug: bool = False,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be positive")
        self.page_size = int(page_size)
        self.pool = BlockPool(num_pages)
        self.prefix = PrefixCache(num_pages)
        self.slots = StateSlotPool(num_state_slots)
        self.needs_state_slot = num_state_slots > 0
        if self.needs_state_slot and num_state_slots < 2:
            raise ValueError("num_state_slots must be 0 or at least 2 (slot 0 is reserved)")
        self.prefix_caching = bool(enable_prefix_caching) and (
            not self.needs_state_slot or state_snapshots
        )
        if enable_prefix_caching and not self.prefix_caching:
            logger.info(
                "prefix caching is off: the model has recurrent layers (ssm/conv/delta) whose "
                "state after a prefix is one per-sequence slot, and no spare slots keep copies"
            )
        #: recurrent-state snapshots at page boundaries (``None`` without recurrent reuse)
        self.snapshots: StateSnapshots | None = (
            StateSnapshots(self.slots) if self.prefix_caching and self.needs_state_slot else None
        )
        # a host tier moves pages only: a recurrent model's reuse needs its snapshots too
        self.host = host_tier if self.prefix_caching and self.snapshots is None else None
        if host_tier is not None and self.host is None:
            logger.info("host KV tier is off because prefix caching is off")
        if self.host is not None and self.host.device_caches[0].shape[0] != num_pages:
            raise ValueError(
                f"host tier caches have {self.host.device_caches[0].shape[0]} pages, "
                f"the manager {num_pages}"
            )
        self.debug = debug
        self._reserved_pages = 0
        self._reserved_slots = 0
        self.stats = KVCacheStats()

    # -- sizes ----------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        """Pages in the pool including the scratch page."""
        return self.pool.num_pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens (ceil division)."""
        return cdiv(num_tokens, self.page_size)

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation may take now: free + idle cached - reserved for admission."""
        return self.pool.num_free + self.prefix.num_evictable - self._reserved_pages

    @property
    def num_used_pages(self) -> int:
        """Pages with at least one user."""
        return self.pool.num_usable - self.pool.num_free - self.prefix.num_evictable

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by requests."""
        return self.num_used_pages / self.pool.num_usable

    def check_fits(self, request: Request) -> None:
        """Reject a request that could not run even with the whole pool to itself.

        :raises OutOfKVMemoryError: with the sizes and what to change.
        """
        need = self.pages_for(request.capacity)
        if need > self.pool.num_usable:
            most = self.pool.num_usable * self.page_size
            raise OutOfKVMemoryError(
                f"request {request.request_id!r} needs up to {request.capacity} tokens "
                f"(prompt {request.num_prompt_tokens} + max_tokens {request.max_tokens}) = "
                f"{need} KV pages of {self.page_size} tokens, but the whole KV cache holds "
                f"{self.pool.num_usable} pages ({most} tokens); lower max_tokens, shorten the "
                "prompt, or give the KV cache more memory (kv_memory / num_kv_pages)"
            )
        if self.needs_state_slot and self.slots.num_slots < 2:
            raise OutOfKVMemoryError("no recurrent-state slot exists; set num_state_slots >= 2")

    def _state(self, request: Request) -> RequestKV:
        st = request.kv_state
        if st is None:
            st = RequestKV(self.pages_for(request.capacity))
            request.kv_state = st
        return st

    # -- phase 1 --------------------------------------------------------------------------------

    def claim(self, request: Request) -> Claim:
        """Phase 1: claim every cached page (device or host) matching the request's prefix.

        At most ``(num_tokens - 1) // page_size`` pages are matched: the last
        token is always computed, so a full hit still produces logits. A request
        that needs the logits of its prompt (``request.skips_prefix_cache``:
        prompt logprobs) matches none.

        :param request: a waiting (or preempted) request holding no pages.
        :return: the claim; give it to :meth:`reserve` then :meth:`allocate_claimed`,
            or back with :meth:`unclaim`.
        """
        st = self._state(request)
        if st.num_pages or st.claim is not None:
            raise RuntimeError(f"request {request.request_id!r} already holds or claimed pages")
        hits: list[tuple[int, int]] = []
        limit = 0
        if self.prefix_caching and not request.skips_prefix_cache:
            limit = (request.num_tokens - 1) // self.page_size
            hashes = st.hashes
            hash_pages(request.token_buffer, self.page_size, hashes, limit)
            refs = self.pool.ref_counts
            prefix = self.prefix
            host = self.host
            for i in range(limit):
                h = hashes[i]
                d = prefix.get(h)
                if d is not None:
                    # Taking an idle page may eat into pages reserved for requests
                    # claimed earlier in this batch; the request then needs at least
                    # one fresh page itself, so its reserve() fails and unclaim()
                    # restores the pool: reservations are never broken.
                    if refs[d] == 0:
                        prefix.take(d)
                    refs[d] += 1
                    hits.append((d, -1))
                    continue
                hp = host.get(h) if host is not None else None
                if hp is None:
                    break
                host.claim(hp)
                hits.append((-1, hp))
        claim = Claim(request, hits, limit, self.page_size)
        if self.snapshots is not None and hits:
            self._cut_to_snapshot(claim, st.hashes)
        st.claim = claim
        return claim

    def _cut_to_snapshot(self, claim: Claim, hashes: list[int]) -> None:
        """Keep the longest run of hits ending at a page with a recurrent-state snapshot.

        Pages past it go back (the request computes them), and the snapshot is
        pinned until the request is admitted or gives its claim back.
        """
        snaps = self.snapshots
        assert snaps is not None
        hits = claim.hits
        keep = len(hits)
        while keep and snaps.get(hashes[keep - 1]) is None:
            keep -= 1
        if keep < len(hits):
            self._drop_hits(hits[keep:])
            del hits[keep:]
            claim.num_host_hits = sum(1 for d, _ in hits if d < 0)
        if keep:
            slot = snaps.get(hashes[keep - 1])
            assert slot is not None
            snaps.pin(slot)
            claim.state_snapshot = slot

    def unclaim(self, claim: Claim) -> None:
        """Give back a claim that will not be admitted (pages return to the LRU)."""
        st = claim.request.kv_state
        self._reserved_pages -= claim.reserved_pages
        self._reserved_slots -= int(claim.reserved_slot)
        claim.reserved_pages = 0
        claim.reserved_slot = False
        for d, hp in reversed(claim.hits):
            if d >= 0:
                self._release_page(d)
            else:
                self.host.unclaim(hp)  # type: ignore[union-attr]
        claim.hits = []
        self._unpin_snapshot(claim)
        st.claim = None

    def reserve(self, claim: Claim, num_new_tokens: int) -> bool:
        """Set aside the device pages (and state slot) the claimed request needs.

        :param claim: a phase-1 claim.
        :param num_new_tokens: tokens the request computes this step, after its cached ones.
        :return: False (nothing reserved) if memory or slots do not suffice.
        """
        need = self.pages_for(claim.num_cached_tokens + num_new_tokens) - claim.num_device_hits
        need = max(need, 0)
        if need > self.num_available_pages:
            return False
        if self.needs_state_slot and self.num_available_slots < 1:
            return False
        self._reserved_pages += need
        claim.reserved_pages = need
        if self.needs_state_slot:
            self._reserved_slots += 1
            claim.reserved_slot = True
        claim.num_new_tokens = num_new_tokens
        return True

    # -- phase 2 --------------------------------------------------------------------------------

    def allocate_claimed(self, claims: list[Claim]) -> None:
        """Phase 2: onboard claimed host pages and allocate new pages for every claim.

        Sets each request's page table, state slot, ``num_computed_tokens``
        (the realised cached tokens) and per-request stats. The pages of the
        whole batch are allocated in one go, so evictions (and their host
        offloads) and onboarding copies are each issued as one batch.

        :param claims: reserved claims of the batch (all claimed before this call).
        """
        ps = self.page_size
        prefix = self.prefix
        refs = self.pool.ref_counts
        host = self.host
        # Pass 1: validate the claims, decide which host hits need a copy (a
        # prefix shared by several requests of the batch is onboarded once).
        plans: list[tuple[Claim, int, list[int], int]] = []
        pending: dict[int, int] = {}  # hash -> index into the batch's page allocation
        onboard: list[tuple[int, int]] = []  # (index into the allocation, host page) to copy
        need = 0
        for c in claims:
            st: RequestKV = c.request.kv_state
            slots: list[int] = []  # per hit: -1 device page, else index into the allocation
            realised = len(c.hits)
            for i, (d, hp) in enumerate(c.hits):
                h = st.hashes[i]
                if d >= 0:
                    if prefix.hash_of(d) != h:  # a claimed page changed: a bug
                        realised = i
                        break
                    slots.append(-1)
                    continue
                if host is None or host.hash_of(hp) != h:
                    realised = i
                    break
                j = pending.get(h)
                if j is None:
                    j = pending[h] = need
                    onboard.append((j, hp))
                    need += 1
                slots.append(j)
            if realised < len(c.hits):
                if c.state_snapshot != NULL_SLOT:
                    # the snapshot holds the state after the last hit: nothing shorter is usable
                    realised = 0
                self._drop_hits(c.hits[realised:])
            total = self.pages_for(realised * ps + c.num_new_tokens)
            plans.append((c, realised, slots, need))
            need += total - realised
        self._reserved_pages -= sum(c.reserved_pages for c in claims)
        for c in claims:
            c.reserved_pages = 0
        pages: list[int] = []
        try:
            if need > self.pool.num_free + prefix.num_evictable:
                raise RuntimeError(f"admission needs {need} pages beyond its reservation")
            pages = self._alloc(need).tolist()
            # Onboard before any page is registered or handed out: a failed copy
            # leaves only fresh pages and claims behind, which are undone here.
            if onboard:
                host.onboard(  # type: ignore[union-attr]
                    [hp for _, hp in onboard], [pages[j] for j, _ in onboard]
                )
        except BaseException:
            self._unwind_admission(plans, pages)
            raise
        # Pass 2: fill the page tables; the first user of an onboarded page owns
        # the allocation's reference, later users of the batch share it.
        owner_done: set[int] = set()
        for c, realised, slots, start in plans:
            req = c.request
            st = req.kv_state
            table = st.pages
            reused = onboarded = 0
            for i in range(realised):
                j = slots[i]
                if j < 0:
                    table[i] = c.hits[i][0]
                    reused += 1
                    continue
                d = pages[j]
                table[i] = d
                if j in owner_done:
                    refs[d] += 1
                    reused += 1
                else:
                    owner_done.add(j)
                    prefix.register(d, st.hashes[i])
                    onboarded += 1
            cached = realised * ps
            total = self.pages_for(cached + c.num_new_tokens)
            fresh = total - realised
            table[realised:total] = pages[start : start + fresh]
            st.set_num_pages(total)
            st.num_registered = realised
            if c.reserved_slot:
                self._reserved_slots -= 1
                c.reserved_slot = False
                st.slot = self._take_slot()
                if realised and c.state_snapshot != NULL_SLOT:
                    self.snapshots.restore(c.state_snapshot, st.slot)  # type: ignore[union-attr]
            req.num_computed_tokens = cached
            s = req.stats
            s.reused_pages += reused
            s.reused_tokens += reused * ps
            s.onboarded_pages += onboarded
            s.onboarded_tokens += onboarded * ps
            s.new_pages += fresh
            s.missed_pages += c.num_lookup - len(c.hits)
            s.missed_tokens += req.num_tokens - cached
            g = self.stats
            g.admissions += 1
            g.lookup_pages += c.num_lookup
            g.device_hit_pages += c.num_device_hits
            g.host_hit_pages += c.num_host_hits
            g.estimated_reused_tokens += c.num_cached_tokens
            g.realised_reused_tokens += cached
            g.new_pages += fresh
            if cached != c.num_cached_tokens:
                msg = (
                    f"request {req.request_id!r}: admission promised {c.num_cached_tokens} "
                    f"cached tokens but delivered {cached}"
                )
                if self.debug:
                    raise AssertionError(msg)
                logger.error(msg)
        self.stats.onboarded_pages += len(onboard)
        # Host claims end once the copies out of them are queued (copies run in order).
        for c in claims:
            for d, hp in c.hits:
                if d < 0:
                    host.unclaim(hp)  # type: ignore[union-attr]
            # every slot of the batch is taken: the restores are queued, the snapshots may go
            self._unpin_snapshot(c)
            c.request.kv_state.claim = None
        if self.debug:
            assert self._reserved_pages >= 0 and self._reserved_slots >= 0

    def _unwind_admission(
        self, plans: list[tuple[Claim, int, list[int], int]], pages: list[int]
    ) -> None:
        """Undo a batch admission that failed before any page table was filled.

        The fresh pages go back to the free stack, every claim is given back
        (device hits kept in pass 1, every host hit) and the state-slot
        reservations end: the requests hold nothing, as before :meth:`claim`.
        """
        if pages:
            fresh = np.asarray(pages, dtype=np.int32)
            self.pool.ref_counts[fresh] = 0
            self.pool.push_free(fresh)
        for c, realised, _, _ in plans:
            self._drop_hits(c.hits[:realised])  # the rest was dropped in pass 1
            for d, hp in c.hits:
                if d < 0:
                    self.host.unclaim(hp)  # type: ignore[union-attr]
            c.hits = []
            if c.reserved_slot:
                self._reserved_slots -= 1
                c.reserved_slot = False
            self._unpin_snapshot(c)
            c.request.kv_state.claim = None

    def _drop_hits(self, hits: list[tuple[int, int]]) -> None:
        """Release device claims of hits that will not be used (host claims end later)."""
        for d, _ in reversed(hits):
            if d >= 0:
                self._release_page(d)

    # -- running requests ---------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of a running request.

        :return: False (nothing allocated) if the pool cannot provide the pages.
        """
        st: RequestKV = request.kv_state
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.page_size)
        extra = total - st.num_pages
        if extra <= 0:
            return True
        if extra > self.num_available_pages:
            return False
        if extra == 1 and self.pool.num_free:
            st.pages[st.num_pages] = self.pool.allocate_one()
        else:
            st.pages[st.num_pages : total] = self._alloc(extra)
        st.set_num_pages(total)
        request.stats.new_pages += extra
        self.stats.new_pages += extra
        return True

    def on_computed(self, request: Request) -> None:
        """Offer the request's newly completed full pages to the prefix cache.

        Call after ``request.num_computed_tokens`` advanced (the step's KV is written).
        """
        if not self.prefix_caching:
            return
        st: RequestKV = request.kv_state
        full = request.num_computed_tokens // self.page_size
        if full <= st.num_registered:
            return
        hash_pages(request.token_buffer, self.page_size, st.hashes, full)
        register = self.prefix.register
        pages = st.pages
        hashes = st.hashes
        for i in range(st.num_registered, full):
            register(int(pages[i]), hashes[i])
        st.num_registered = full

    def release_tail(self, request: Request, num_tokens: int) -> int:
        """Give back the request's pages past those holding its first ``num_tokens`` tokens.

        Speculative verification reserves pages for every draft token; when drafts
        are rejected, the pages that held only rejected tokens go back (never
        registered in the prefix cache: only pages of computed tokens are).

        :param request: a running request.
        :param num_tokens: tokens whose pages it keeps.
        :return: how many pages went back.
        """
        st: RequestKV = request.kv_state
        keep = cdiv(num_tokens, self.page_size)
        n = st.num_pages
        if keep >= n:
            return 0
        pages = st.pages[keep:n][::-1]
        refs = self.pool.ref_counts
        refs[pages] -= 1
        self._let_go(pages[refs[pages] == 0].tolist())
        st.set_num_pages(keep)
        return n - keep

    def free(self, request: Request) -> None:
        """Release everything the request holds (finish, abort, preemption).

        Cached pages go to the LRU, tail pages first, so a sequence's shared
        head stays cached longest; other pages go back to the free stack.
        """
        st: RequestKV | None = request.kv_state
        if st is None:
            return
        if st.claim is not None:
            self.unclaim(st.claim)
        n = st.num_pages
        if n:
            pages = st.pages[:n][::-1]
            refs = self.pool.ref_counts
            refs[pages] -= 1
            self._let_go(pages[refs[pages] == 0].tolist())
            st.set_num_pages(0)
            st.num_registered = 0
        if st.slot != NULL_SLOT:
            self.slots.free(st.slot)
            st.slot = NULL_SLOT
        request.num_computed_tokens = 0

    def wait_transfers(self) -> None:
        """Order the compute stream after queued host-tier copies (no host sync)."""
        if self.host is not None:
            self.host.wait()

    # -- recurrent-state snapshots ----------------------------------------------------------------

    @property
    def num_live_slots(self) -> int:
        """State slots held by requests (the rest of the used ones hold snapshots)."""
        held = len(self.snapshots) if self.snapshots is not None else 0
        return self.slots.num_used - held

    @property
    def num_available_slots(self) -> int:
        """State slots an admission may take now: free + idle snapshots - reserved."""
        idle = self.snapshots.num_evictable if self.snapshots is not None else 0
        return self.slots.num_free + idle - self._reserved_slots

    def snapshot_cut(self, request: Request, num_new_tokens: int, start: int | None = None) -> int:
        """Shorten a prefill chunk so that it ends where the request's state is to be kept.

        A recurrent model keeps its state after the prompt's last full page
        (see :meth:`save_state`), which a step can only see when a chunk ends
        there; a chunk that would run past that position without a snapshot of
        it stops there instead (the rest follows in the next step).

        :param request: a request about to compute ``num_new_tokens`` tokens.
        :param num_new_tokens: the chunk's size.
        :param start: the chunk's first position (default ``request.num_computed_tokens``;
            a request being admitted passes its claim's cached tokens).
        :return: the chunk's size, cut where needed.
        """
        if self.snapshots is None:
            return num_new_tokens
        c = request.num_computed_tokens if start is None else start
        b = self.snapshot_position(request)
        if not c < b < c + num_new_tokens:
            return num_new_tokens
        st: RequestKV = request.kv_state
        hash_pages(request.token_buffer, self.page_size, st.hashes, b // self.page_size)
        if self.snapshots.get(st.hashes[b // self.page_size - 1]) is not None:
            return num_new_tokens
        return b - c

    def snapshot_position(self, request: Request) -> int:
        """The position after which the request's recurrent state is kept: its prompt's
        last full page boundary (0: none)."""
        ps = self.page_size
        return request.num_prompt_tokens // ps * ps

    def save_state(self, request: Request) -> bool:
        """Keep the request's recurrent state after its first ``num_computed_tokens`` tokens
        (a page boundary whose KV was just computed) for requests sharing that prefix.

        :param request: a running request whose slot holds the state at that position.
        :return: True if a snapshot was recorded (its copy goes out with the next step).
        """
        snaps = self.snapshots
        n = request.num_computed_tokens
        if snaps is None or n <= 0 or n % self.page_size:
            return False
        st: RequestKV = request.kv_state
        pages = n // self.page_size
        hash_pages(request.token_buffer, self.page_size, st.hashes, pages)
        return snaps.save(st.hashes[pages - 1], st.slot)

    def take_state_copies(self) -> tuple[StateCopies, StateCopies]:
        """The state copies to issue before the next step's forward (saves, then restores).

        :return: ``(saves, restores)`` of ``(source slot, destination slot)``; empty
            without recurrent-state snapshots.
        """
        if self.snapshots is None:
            return [], []
        return self.snapshots.take_copies()

    def discard_state_saves(self, saves: StateCopies) -> None:
        """Forget the snapshots whose save copies never ran (their step failed)."""
        if self.snapshots is not None and saves:
            self.snapshots.discard(saves)

    def _take_slot(self) -> int:
        if self.snapshots is not None:
            return self.snapshots.take_slot()
        return self.slots.allocate()

    def _unpin_snapshot(self, claim: Claim) -> None:
        if claim.state_snapshot != NULL_SLOT:
            self.snapshots.unpin(claim.state_snapshot)  # type: ignore[union-attr]
            claim.state_snapshot = NULL_SLOT

    # -- internals ------------------------------------------------------------------------------

    def _release_page(self, page: int) -> None:
        """Drop one user of ``page``."""
        refs = self.pool.ref_counts
        r = refs[page] - 1
        refs[page] = r
        if r == 0:
            self._let_go([page])

    def _let_go(self, pages: list[int]) -> None:
        """Put away pages that just lost their last user.

        A cached page stays reusable as the most recently used idle page of the
        prefix cache; any other page goes back to the free stack.
        """
        prefix = self.prefix
        free = []
        for p in pages:
            if prefix.is_cached(p):
                prefix.park(p)
            else:
                free.append(p)
        if free:
            self.pool.push_free(np.asarray(free, dtype=np.int32))

    def _evict(self, n: int) -> None:
        """Evict ``n`` idle cached pages to the free stack, offloading them to the host."""
        evicted = [self.prefix.evict() for _ in range(n)]
        pages = [p for p, _ in evicted]
        if self.host is not None:
            try:
                self.stats.offloaded_pages += self.host.offload(pages, [h for _, h in evicted])
            except Exception:
                # The host tier is a cache: losing these pages only costs their
                # recomputation, so the allocation that evicted them goes on.
                logger.warning(
                    "copying %d evicted KV pages to the host tier failed; they are dropped",
                    n,
                    exc_info=True,
                )
        self.pool.push_free(np.asarray(pages, dtype=np.int32))
        self.stats.evicted_pages += n

    def _alloc(self, n: int) -> np.ndarray:
        if n <= 0:
            return _EMPTY
        short = n - self.pool.num_free
        if short > 0:
            self._evict(short)
        return self.pool.allocate(n)

    # -- checks ---------------------------------------------------------------------------------

    def check_invariants(self, live: list[Request]) -> None:
        """Assert the bookkeeping is consistent (tests; O(pages)).

        :param live: every request currently holding pages or claims.
        """
        n = self.pool.num_pages
        refs = self.pool.ref_counts
        free = self.pool.free_pages().tolist()
        lru = self.prefix.idle_pages()
        assert len(set(free)) == len(free), "a page is twice on the free stack"
        assert NULL_PAGE not in free and NULL_PAGE not in lru, "scratch page handed out"
        assert refs[NULL_PAGE] == 0
        users = np.zeros(n, dtype=np.int64)
        for r in live:
            st: RequestKV = r.kv_state
            tbl = st.page_table
            assert NULL_PAGE not in tbl.tolist(), "scratch page in a page table"
            assert len(set(tbl.tolist())) == len(tbl), "a request holds a page twice"
            users[tbl] += 1
            if st.claim is not None:
                for d, _ in st.claim.hits:
                    if d >= 0:
                        users[d] += 1
        assert (users == refs).all(), "reference counts differ from live users"
        for p in free:
            assert refs[p] == 0, f"page {p} free and referenced"
            assert not self.prefix.is_cached(p), f"page {p} free and cached"
        for p in lru:
            assert refs[p] == 0, f"page {p} evictable and referenced"
        assert not set(free) & set(lru)
        accounted = len(free) + len(lru) + int((refs[1:] > 0).sum())
        assert accounted == n - 1, f"{n - 1 - accounted} pages leaked"
        self.prefix.check_invariants()
        assert self._reserved_pages >= 0
        if self.needs_state_slot:
            live_slots = [r.kv_state.slot for r in live if r.kv_state.slot != NULL_SLOT]
            assert len(set(live_slots)) == len(live_slots), "two requests share a state slot"
            held = len(self.snapshots) if self.snapshots is not None else 0
            assert self.slots.num_used == len(live_slots) + held, "a state slot leaked"
            if self.snapshots is not None:
                self.snapshots.check_invariants()
                assert not set(live_slots) & self.snapshots.held_slots(), "live slot cached"
        if self.host is not None:
            self.host.check_invariants()
