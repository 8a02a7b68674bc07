"""Host (CPU) tier of the KV cache: keeps evicted reusable pages, onboards them back.

When the device prefix cache evicts an idle cached page, its content (that page
of *every* paged cache tensor: all layers' K/V or MLA latents) is copied into
a host page and the page's chained hash is remembered. A later request whose
prefix reaches that hash gets the page copied back ("onboarded") instead of
recomputing it.

Copies: on CUDA they run on a side stream. Device-to-host copies first wait
for the compute stream (the forward that wrote the page must be done); the
compute stream waits for the side stream's last event before the next forward
(:meth:`HostTier.wait`), so a freshly onboarded page is complete before
attention reads it and an evicted page is saved before its new owner writes
it. All copies share one stream, so they run in issue order: an offload into a
host page issued after an onboard out of it cannot overtake it. On CPU the
copies are plain synchronous ``index_copy_``.

Host pages have their own claim counts and LRU: a host page claimed during
batch admission (phase 1) is never evicted to make room for an offload.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

__all__ = ["HostTier"]

logger = logging.getLogger(__name__)


def _runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """Split index pairs into runs consecutive on both sides: ``(src, dst, length)``."""
    if len(src) == 0:
        return []
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], brk))
    lens = np.diff(np.concatenate((starts, [len(src)])))
    return [(int(src[s]), int(dst[s]), int(n)) for s, n in zip(starts, lens, strict=True)]


class HostTier:
    """A pool of host pages mirroring the paged cache tensors.

    :param device_caches: every paged cache tensor of the model (dim 0 = page
        index, same number of pages in each); their page contents are moved.
    :param num_host_pages: pages the host tier holds.
    :param pin_memory: pin the host tensors (default: when the caches are on CUDA).
    """

    def __init__(
        self,
        device_caches: Sequence[torch.Tensor],
        num_host_pages: int,
        *,
        pin_memory: bool | None = None,
    ) -> None:
        if not device_caches:
            raise ValueError("the host tier needs at least one paged cache tensor")
        n_dev = {int(t.shape[0]) for t in device_caches}
        if len(n_dev) != 1:
            raise ValueError(f"paged caches disagree on the number of pages: {sorted(n_dev)}")
        self.device_caches = list(device_caches)
        self.device = self.device_caches[0].device
        self.is_cuda = self.device.type == "cuda"
        pin = self.is_cuda if pin_memory is None else pin_memory
        self.num_pages = int(num_host_pages)
        self.host_caches = [
            torch.empty((self.num_pages, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
            for t in self.device_caches
        ]
        self._map: dict[int, int] = {}
        self._page_hash: list[int | None] = [None] * self.num_pages
        self._claims = [0] * self.num_pages
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unclaimed
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        # CPU: numpy byte views ([pages, bytes]) make page gathers plain memcpys
        # (torch's CPU index ops are several times slower for this, and threaded).
        self._np_views: dict[int, np.ndarray] | None = None
        if not self.is_cuda and all(t.is_contiguous() for t in self.device_caches):
            self._np_views = {
                id(t): t.view(t.shape[0], -1).view(torch.uint8).numpy()
                for t in (*self.device_caches, *self.host_caches)
            }
        self._event: torch.cuda.Event | None = None
        self.num_offloaded = 0
        self.num_onboarded = 0
        self.num_dropped = 0
        self.num_evicted = 0
        #: called with ``(src_pages, dst_pages, to_host)`` after each copy this tier
        #: makes, so that the other ranks of a tensor-parallel engine copy the same
        #: pages of their own cache shards (:meth:`copy_pages`); ``None``: one rank
        self.on_copy: Callable[[Sequence[int], Sequence[int], bool], None] | None = None

    @staticmethod
    def bytes_per_page(device_caches: Sequence[torch.Tensor]) -> int:
        """Host bytes one page takes (that page of every cache tensor)."""
        return sum(t[0].numel() * t.element_size() for t in device_caches)

    @classmethod
    def from_bytes(
        cls, device_caches: Sequence[torch.Tensor], host_bytes: int, **kw: bool | None
    ) -> HostTier:
        """Build a tier holding as many pages as fit in ``host_bytes``.

        :param device_caches: the paged cache tensors.
        :param host_bytes: host memory budget (``EngineConfig.host_kv_memory``).
        """
        per = cls.bytes_per_page(device_caches)
        n = int(host_bytes) // max(per, 1)
        if n < 1:
            raise ValueError(
                f"host_kv_memory={host_bytes} bytes holds no page (one page takes {per} bytes); "
                "raise host_kv_memory or set it to 0 to turn the host tier off"
            )
        return cls(device_caches, n, **kw)

    # -- lookup and claims ---------------------------------------------------------------------

    def __len__(self) -> int:
        """Host pages holding a prefix."""
        return len(self._map)

    def get(self, h: int) -> int | None:
        """The host page holding the prefix hashed ``h``, if any."""
        return self._map.get(h)

    def hash_of(self, page: int) -> int | None:
        """The chained hash of the prefix host page ``page`` holds, ``None`` when it holds none."""
        return self._page_hash[page]

    def claim(self, page: int) -> None:
        """Protect a host page from eviction until :meth:`unclaim` (admission phase 1)."""
        c = self._claims[page]
        if c == 0:
            del self._lru[page]
        self._claims[page] = c + 1

    def unclaim(self, page: int) -> None:
        """Drop one claim; an unclaimed page becomes the most recently used."""
        c = self._claims[page] - 1
        self._claims[page] = c
        if c == 0:
            self._lru[page] = None

    def num_claimed(self) -> int:
        """Host pages with at least one claim."""
        return sum(1 for c in self._claims if c)

    # -- copies ------------------------------------------------------------------------------------

    def offload(self, device_pages: Sequence[int], hashes: Sequence[int]) -> int:
        """Copy evicted device pages to host pages and remember their hashes.

        Pages whose hash is already on the host are only refreshed in the LRU.
        When the host is full, the least recently used unclaimed host page is
        evicted; if every host page is claimed the device page is dropped.

        :param device_pages: evicted device pages (still holding their content).
        :param hashes: their chained hashes.
        :return: number of pages copied.
        """
        src: list[int] = []
        dst: list[int] = []
        fresh: set[int] = set()  # host pages filled by this call
        for d, h in zip(device_pages, hashes, strict=True):
            hp = self._map.get(h)
            if hp is not None:
                if self._claims[hp] == 0:
                    self._lru.move_to_end(hp)
                continue
            if self._free:
                hp = self._free.pop()
            elif self._lru and next(iter(self._lru)) not in fresh:
                # never recycle a page this call just filled: its copy is queued
                hp, _ = self._lru.popitem(last=False)
                del self._map[self._page_hash[hp]]  # type: ignore[index]
                self.num_evicted += 1
            else:
                self.num_dropped += 1
                continue
            fresh.add(hp)
            self._map[h] = hp
            self._page_hash[hp] = h
            self._lru[hp] = None
            src.append(d)
            dst.append(hp)
        if src:
            try:
                self._copy(self.device_caches, self.host_caches, src, dst, to_host=True)
                if self.on_copy is not None:
                    self.on_copy(src, dst, True)
            except BaseException:
                self._forget(dst)  # their content is unknown now
                raise
            self.num_offloaded += len(src)
        return len(src)

    def _forget(self, pages: Sequence[int]) -> None:
        """Turn unclaimed host pages back into free pages holding nothing."""
        for hp in pages:
            h = self._page_hash[hp]
            if h is not None:
                del self._map[h]
                self._page_hash[hp] = None
            self._lru.pop(hp, None)
            self._free.append(hp)

    def onboard(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        """Copy host pages into (freshly allocated) device pages.

        A copy that raises leaves the host pages as they were (a copy only reads them).

        :param host_pages: source host pages (claimed by the caller until this returns).
        :param device_pages: destination device pages.
        """
        if len(host_pages):
            self._copy(
                self.host_caches, self.device_caches, host_pages, device_pages, to_host=False
            )
            if self.on_copy is not None:
                self.on_copy(host_pages, device_pages, False)
            self.num_onboarded += len(host_pages)

    def copy_pages(
        self, src_pages: Sequence[int], dst_pages: Sequence[int], *, to_host: bool
    ) -> None:
        """Copy pages between the device caches and the host pages, without bookkeeping.

        For the other ranks of a tensor-parallel engine: they repeat the copies
        the driver's tier made (its :attr:`on_copy`), on their own cache shards.

        :param src_pages: source pages (device pages if ``to_host``, else host pages).
        :param dst_pages: destination pages, one per source page.
        :param to_host: device to host (an offload) or host to device (an onboard).
        """
        if to_host:
            self._copy(self.device_caches, self.host_caches, src_pages, dst_pages, to_host=True)
        else:
            self._copy(self.host_caches, self.device_caches, src_pages, dst_pages, to_host=False)

    def _copy(
        self,
        srcs: list[torch.Tensor],
        dsts: list[torch.Tensor],
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        *,
        to_host: bool,
    ) -> None:
        """Copy pages ``src_pages`` of every tensor in ``srcs`` to ``dst_pages`` of ``dsts``.

        CUDA: the device side is gathered/scattered by one index kernel per
        tensor; only runs of consecutive host pages become separate transfers
        (host pages of one offload are handed out consecutively, so runs are long).
        """
        src = np.asarray(src_pages, dtype=np.int64)
        dst = np.asarray(dst_pages, dtype=np.int64)
        if self._np_views is not None:
            views = self._np_views
            for s, d in zip(srcs, dsts, strict=True):
                views[id(d)][dst] = views[id(s)][src]
            return
        if self._stream is None:
            si = torch.from_numpy(src)
            di = torch.from_numpy(dst)
            for s, d in zip(srcs, dsts, strict=True):
                d.index_copy_(0, di, s.index_select(0, si))
            return
        stream = self._stream
        # The compute stream's queued work (the forward that wrote these pages, or
        # earlier users of the destination pages) must finish before the copy.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Sort by host page: the device side is indexed anyway, and host pages
        # that are consecutive in any order then become one transfer each run
        # (a sequence's pages are evicted tail first, i.e. in descending order).
        order = np.argsort(dst if to_host else src, kind="stable")
        src = src[order]
        dst = dst[order]
        host_side = dst if to_host else src
        runs = _runs(np.arange(len(host_side)), host_side)  # (batch pos, host page, n)
        with torch.cuda.stream(stream):
            # A pageable upload would wait for every copy already queued on this
            # stream (and block the host meanwhile); a pinned one stays asynchronous.
            idx = torch.from_numpy(src if to_host else dst).pin_memory()
            idx = idx.to(self.device, non_blocking=True)
            for s_t, d_t in zip(srcs, dsts, strict=True):
                if to_host:
                    g = s_t.index_select(0, idx)
                    for k, h, n in runs:
                        d_t[h : h + n].copy_(g[k : k + n], non_blocking=True)
                else:
                    g = torch.empty((len(src), *s_t.shape[1:]), dtype=s_t.dtype, device=self.device)
                    for k, h, n in runs:
                        g[k : k + n].copy_(s_t[h : h + n], non_blocking=True)
                    d_t.index_copy_(0, idx, g)
            ev = torch.cuda.Event()
            ev.record(stream)
        self._event = ev

    def wait(self) -> None:
        """Make the compute stream wait for every copy issued so far (no host sync)."""
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
            self._event = None

    def synchronize(self) -> None:
        """Block the host until every copy issued so far is done (tests, shutdown)."""
        if self._stream is not None:
            self._stream.synchronize()

    def check_invariants(self) -> None:
        """Assert the host bookkeeping is consistent (tests)."""
        cached = {p for p in range(self.num_pages) if self._page_hash[p] is not None}
        assert cached == set(self._map.values())
        assert not cached & set(self._free)
        assert set(self._lru) == {p for p in cached if self._claims[p] == 0}
        assert all(c >= 0 for c in self._claims)
        assert all(self._page_hash[p] is not None for p in range(self.num_pages) if self._claims[p])
        assert len(self._free) + len(cached) == self.num_pages
