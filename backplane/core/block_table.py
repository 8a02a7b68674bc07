"""A block table kept between steps: rows rewritten only where a sequence's pages changed.

A decode step of hundreds of sequences changes the page tables of only the few
sequences that crossed a page boundary; joining every table again each step is
most of the cost of packing it. :class:`PersistentBlockTable` holds one row per
packing position and rewrites a row only when the page table given at that
position is not the array it was given last time.

The page tables are taken as snapshots: an array given again (the same object)
must hold the same entries in its length. The engine's KV manager works this way:
a request's ``RequestKV.table`` is a new view whenever its pages change.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from backplane.core.metadata import NULL_PAGE

__all__ = ["PersistentBlockTable"]


class PersistentBlockTable:
    """Page tables of the sequences of the last step, one row per packing position.

    Row ``j`` holds the table last given at position ``j``, then ``NULL_PAGE``.

    :param max_rows: most sequences of one step.
    :param max_pages: most pages of one sequence (columns).
    """

    def __init__(self, max_rows: int, max_pages: int) -> None:
        self.max_rows = int(max_rows)
        self.max_pages = max(int(max_pages), 1)
        self.rows = np.full((self.max_rows, self.max_pages), NULL_PAGE, dtype=np.int32)
        #: pages of the table behind each row (those past ``max_pages`` are not stored)
        self.lens = np.zeros(self.max_rows, dtype=np.int64)
        # the array each row was written from: kept alive so that identity means "unchanged"
        self._sources: list[np.ndarray | None] = [None] * self.max_rows
        #: rows rewritten by the last :meth:`update` (for tests and statistics)
        self.rewritten = 0
        #: above this many changed rows they are rewritten in one vectorised pass
        self.vectorise_from = 32

    def update(self, page_tables: Sequence[np.ndarray]) -> None:
        """Make rows ``0..len(page_tables)-1`` hold these page tables.

        :param page_tables: one page table per sequence, in packing order.
        :raises ValueError: more tables than rows.
        """
        n = len(page_tables)
        if n > self.max_rows:
            raise ValueError(
                f"{n} page tables for a block table of {self.max_rows} rows; raise max_rows "
                "to the engine's max_num_seqs"
            )
        sources = self._sources
        changed = [j for j in range(n) if page_tables[j] is not sources[j]]
        self.rewritten = len(changed)
        if len(changed) > self.vectorise_from:
            self._rewrite_many(page_tables, changed)
            return
        rows, lens, width = self.rows, self.lens, self.max_pages
        for j in changed:
            table = page_tables[j]
            m = len(table)
            k = m if m <= width else width
            rows[j, :k] = table[:k]
            old = lens[j]
            if old > k:  # past its table a row holds NULL_PAGE
                rows[j, k:old] = NULL_PAGE
            lens[j] = m
            sources[j] = table

    def _rewrite_many(self, page_tables: Sequence[np.ndarray], changed: list[int]) -> None:
        """Rewrite many rows at once: one join of their tables and one scatter.

        When the sequences move between positions (prefills admitted ahead of
        the decodes) most rows change, and one row write per sequence would cost
        more than the join it saves.
        """
        tables = [page_tables[j] for j in changed]
        at = np.asarray(changed, dtype=np.int64)
        m = np.fromiter(map(len, tables), np.int64, len(tables))
        k = np.minimum(m, self.max_pages)
        total = int(k.sum())
        # past its table a row holds NULL_PAGE: clear as far as the old tables reached
        reach = min(int(self.lens[at].max()), self.max_pages)
        self.rows[at, :reach] = NULL_PAGE
        if total:
            flat = np.concatenate(tables)
            first = np.repeat(np.cumsum(k) - k, k)
            col = np.arange(total, dtype=np.int64) - first
            self.rows[np.repeat(at, k), col] = flat[np.repeat(np.cumsum(m) - m, k) + col]
        self.lens[at] = m
        sources = self._sources
        for j, table in zip(changed, tables, strict=True):
            sources[j] = table

    def forget(self) -> None:
        """Drop every row's source, so the next :meth:`update` rewrites them all."""
        self._sources = [None] * self.max_rows
