"""Prefix reuse: chained hashes of full pages and an LRU of unreferenced cached pages.

The hash of page ``i`` of a token stream covers the page's ``page_size`` token
ids *and* the hash of page ``i - 1``, so equal hashes mean equal prefixes, not
just equal pages. Only full pages whose KV has been computed are registered;
a partially filled page is never shared (its owner would keep writing to it).

A cached page with users is just a referenced page. When its last user lets
go it enters the LRU instead of the free stack: its content stays reusable
until an allocation needs the page, at which point the least recently used
one is evicted (and, with a host tier, copied to host memory first).

Hashes use Python's built-in (per-process salted, 64-bit) ``hash`` of the
parent hash and the page's raw ``int32`` bytes: about 0.2 us per page, cheap
enough to hash long prompts at admission. Hashes are never persisted or
compared across processes.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

__all__ = ["ROOT_HASH", "PrefixCache", "hash_pages"]

#: Parent hash of the first page of every sequence.
ROOT_HASH = 0


def hash_pages(tokens: np.ndarray, page_size: int, hashes: list[int], num_full_pages: int) -> None:
    """Extend ``hashes`` (chained hashes of leading full pages) up to ``num_full_pages``.

    :param tokens: the token stream (``int32``); must hold ``num_full_pages * page_size`` tokens.
    :param page_size: tokens per page.
    :param hashes: hashes already computed for the first ``len(hashes)`` pages; extended in place.
    :param num_full_pages: how many leading pages should be hashed afterwards.
    """
    i = len(hashes)
    if i >= num_full_pages:
        return
    parent = hashes[-1] if i else ROOT_HASH
    data = tokens[i * page_size : num_full_pages * page_size].tobytes()
    step = page_size * tokens.itemsize
    append = hashes.append
    for off in range(0, len(data), step):
        parent = hash((parent, data[off : off + step]))
        append(parent)


class PrefixCache:
    """Maps chained page hashes to device pages and keeps the LRU of idle cached pages.

    :param num_pages: number of pages in the pool (page ids index the cache's tables).
    """

    def __init__(self, num_pages: int) -> None:
        self._map: dict[int, int] = {}
        self._page_hash: list[int | None] = [None] * num_pages
        # Unreferenced cached pages, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        """Device pages holding a registered prefix."""
        return len(self._map)

    @property
    def num_evictable(self) -> int:
        """Cached pages with no users (evictable on demand)."""
        return len(self._lru)

    def get(self, h: int) -> int | None:
        """The device page holding the prefix that ends with hash ``h``, if cached."""
        return self._map.get(h)

    def hash_of(self, page: int) -> int | None:
        """The chained hash of the prefix ``page`` holds, ``None`` when it is not cached."""
        return self._page_hash[page]

    def is_cached(self, page: int) -> bool:
        """True if the page holds registered prefix content."""
        return self._page_hash[page] is not None

    def idle_pages(self) -> list[int]:
        """The idle cached pages, least recently used first (for checks)."""
        return list(self._lru)

    def register(self, page: int, h: int) -> bool:
        """Record that ``page`` (referenced, full, computed) holds the prefix hashed ``h``.

        :return: False if another page already holds that prefix (``page`` stays uncached).
        """
        if h in self._map or self._page_hash[page] is not None:
            return False
        self._map[h] = page
        self._page_hash[page] = h
        return True

    def take(self, page: int) -> None:
        """A cached page gains its first user: it leaves the LRU (no longer evictable)."""
        del self._lru[page]

    def park(self, page: int) -> None:
        """A cached page lost its last user: it becomes the most recently used idle page."""
        self._lru[page] = None

    def evict(self) -> tuple[int, int]:
        """Forget the least recently used idle cached page.

        :return: ``(page, hash)``; the page is now uncached with no users.
        """
        page, _ = self._lru.popitem(last=False)
        h = self._page_hash[page]
        assert h is not None
        del self._map[h]
        self._page_hash[page] = None
        return page, h

    def check_invariants(self) -> None:
        """Assert the hash map and the per-page hashes agree (tests)."""
        for h, p in self._map.items():
            assert self._page_hash[p] == h, f"page {p} is mapped from hash {h} but holds another"
        cached = sum(1 for h in self._page_hash if h is not None)
        assert cached == len(self._map), "a page holds a hash the map does not know"
        assert all(self._page_hash[p] is not None for p in self._lru), "an idle page is uncached"
