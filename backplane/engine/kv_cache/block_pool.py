"""Fixed-size KV page pool: a free stack plus reference counts.

Pages are indices into dim 0 of every paged cache tensor. Page 0 is reserved
scratch (padding sequences of CUDA-graph buckets point at it) and is never
handed out. Allocation pops from the top of a preallocated ``int32`` stack and
freeing pushes back, so both are O(1) per page and vectorised for many pages.

The pool only knows *uncached* free pages. Pages that hold reusable prefix
content and have no users live in the prefix cache's LRU instead (see
:mod:`backplane.engine.kv_cache.prefix_cache`); the manager evicts from there
when the stack runs dry.
"""

from __future__ import annotations

import numpy as np

from backplane.core.metadata import NULL_PAGE

__all__ = ["BlockPool"]


class BlockPool:
    """Free stack + reference counts of ``num_pages`` pages (page 0 reserved).

    :param num_pages: total pages including the reserved page 0 (at least 2).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need the scratch page 0 plus at least one")
        self.num_pages = int(num_pages)
        # Highest ids on top so the first allocations are pages 1, 2, 3, ...
        self._stack = np.arange(self.num_pages - 1, NULL_PAGE, -1, dtype=np.int32)
        self._top = self.num_pages - 1
        self.ref_counts = np.zeros(self.num_pages, dtype=np.int32)

    @property
    def num_usable(self) -> int:
        """Pages a request can ever get (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Uncached pages on the free stack."""
        return self._top

    def allocate(self, n: int) -> np.ndarray:
        """Pop ``n`` free pages and give each a reference count of 1.

        :param n: number of pages; the caller checks :attr:`num_free` first.
        :return: ``int32`` array of page ids.
        :raises MemoryError: if fewer than ``n`` pages are free (a caller bug).
        """
        top = self._top
        if n > top:
            raise MemoryError(f"asked for {n} pages, {top} free")
        pages = self._stack[top - n : top].copy()
        self._top = top - n
        self.ref_counts[pages] = 1
        return pages

    def allocate_one(self) -> int:
        """Pop one free page (fast path of :meth:`allocate` for decode steps)."""
        top = self._top - 1
        if top < 0:
            raise MemoryError("asked for 1 page, 0 free")
        page = int(self._stack[top])
        self._top = top
        self.ref_counts[page] = 1
        return page

    def push_free(self, pages: np.ndarray) -> None:
        """Return pages with no users and no cached content to the free stack.

        :param pages: distinct page ids whose reference count is already 0.
        """
        n = len(pages)
        self._stack[self._top : self._top + n] = pages
        self._top += n

    def free_pages(self) -> np.ndarray:
        """Copy of the page ids on the free stack (for tests and invariants)."""
        return self._stack[: self._top].copy()
